"""The on-disk format: names and sizes, the manifest, dtypes as stored,
layouts, the structure record and its trust list.
"""
