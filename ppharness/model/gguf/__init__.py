"""The GGUF file format read and checked, with no tinygrad and no architecture: the header and tensor infos
(``header``), the metadata's bounds (``metadata``), the tensor names every architecture shares (``names``) and what
the metadata says of a model as plain data (``config``)."""
