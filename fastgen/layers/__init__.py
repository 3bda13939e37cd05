"""Building blocks of the decoder: norms, rotary embedding, MLP and the attention layer."""
