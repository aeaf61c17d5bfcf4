"""The built-in offline tasks: a tiny model, a tokenizer trained on the spot, the prompts."""
