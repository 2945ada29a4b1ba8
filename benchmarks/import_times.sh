#!/usr/bin/env bash
# How long python3 takes to import torch and transformers on this machine, twice each, as the
# image is set up and then with bytecode written to a cache folder (PYTHONPYCACHEPREFIX): on a
# machine whose site-packages hold no bytecode, every process compiles those sources again.
echo "PYTHONDONTWRITEBYTECODE=${PYTHONDONTWRITEBYTECODE-<unset>} PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX-<unset>}"
python3 - <<'PY'
import sys, sysconfig, os
print("dont_write_bytecode", sys.flags.dont_write_bytecode, "pycache_prefix", sys.pycache_prefix)
purelib = sysconfig.get_paths()["purelib"]
import torch
print("torch at", os.path.dirname(torch.__file__), "writable", os.access(os.path.dirname(torch.__file__), os.W_OK))
print("__pycache__ in torch:", os.path.isdir(os.path.join(os.path.dirname(torch.__file__), "__pycache__")))
PY
for module in torch transformers; do
  for env in "as-is" "pycache"; do
    for i in 1 2; do
      TIMEFORMAT="import $module ($env, run $i): %R s"
      if [ $env = as-is ]; then time python3 -c "import $module"; else
        time env -u PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX=/tmp/pycache python3 -c "import $module"; fi
    done
  done
done
