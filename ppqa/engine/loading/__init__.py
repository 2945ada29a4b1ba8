"""Model loading: a spec in (embedded name, GGUF file, HF folder, `dummy:` preset), a config,
lazy weights and a tokenizer out. `loader.load_model` dispatches; `types` holds what all share."""
