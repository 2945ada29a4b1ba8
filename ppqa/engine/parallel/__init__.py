"""Running one model over several devices: `tensor_parallel.py` shards a built model (Megatron's
split, collectives as forward hooks), `lockstep.py` keeps every rank's session making rank 0's
decisions (`follower.py` on the other ranks), `launch.py` starts the ranks of one engine."""
