"""Integrations of moekit with other libraries.

Each submodule imports its library on import, so `import moekit` stays free of them:
- `moekit.integrations.transformers`: Hugging Face transformers MoE models on moekit experts
  (`apply_moekit`, and `experts_implementation="moekit"`). Needs the `hf` extra.
"""
