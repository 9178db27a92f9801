"""Storage: the seam every byte goes through, and what sits behind it.

That is local chunk files, durability, untrusted files, host memory and the
read window, incremental sharing, the lease and the atomic overwrite.
"""
