"""Where a model file comes from: a synthetic spec built once into the cache, a local path, a URL fetched within
bounds, or a file shipped in a Python wheel (``known``)."""
