"""Graph passes: strategy enumeration (one registered rule per op family),
divisibility filtering and follower merging. Imported as ``autopar.passes``."""
