"""moekit's kernel runtime: device facts, the configuration tables, the one plan-and-launch recipe, the
host side of every kernel family and the backends behind one Protocol."""
