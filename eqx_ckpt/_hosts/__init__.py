"""Many hosts: process groups and their barriers, and how sharded arrays are
cut and dealt between processes.
"""
