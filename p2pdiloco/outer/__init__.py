"""The outer step and the merge, as math: pseudo-gradients, token weights, the merge
rules (`step`), the robust screening of a window's deltas (`screening`), and one
fragment's state with the one way it advances (`fragment.outer_update`). Pure: tensors
in, tensors out, bit-identical on every CPU (docs/arithmetic.md)."""
