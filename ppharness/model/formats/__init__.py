"""The ggml weight formats: one table of every type (``table``), the formats the engine computes with
(``codecs``), one family a file (``floats``, ``blocks32``, ``kquants``: unpack, quantise and product together), and a
matrix held as its file packs it (``packed``). The floor below everything else of the model."""
