"""Storage: the seam every byte goes through, local chunk files, durability,
untrusted files, host memory and the read window, incremental sharing, the
lease and the atomic overwrite.
"""
