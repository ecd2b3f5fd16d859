"""Integrations of moekit with other libraries.

Each library's submodule imports its library on import, so `import moekit` stays free of them:
- `moekit.integrations.transformers`: Hugging Face transformers MoE models on moekit experts
  (`apply_moekit`, and `experts_implementation="moekit"`). Needs the `hf` extra.
- `moekit.integrations.experts` (no other library): `IntegratedExperts`, the type by which
  `moekit.distributed` knows an integration's experts module without importing its library.
"""
