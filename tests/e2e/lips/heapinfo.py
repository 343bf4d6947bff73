"""Prints what the collector holds in this LIP: objects frozen, thresholds."""
import gc


def main():
    print(gc.get_freeze_count(), *gc.get_threshold())
