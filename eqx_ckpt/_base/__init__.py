"""The vocabulary every story shares: errors, fault points, progress,
interrupts, key paths, trees, selectors, locations.
"""
