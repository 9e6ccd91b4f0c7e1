"""A stage's share of the model on tinygrad (``slicing.ModelSlice``) and its device step: batched rows, prefill in
chunks, the lean CPU call, the expert bank, the hidden state handed between stages."""
