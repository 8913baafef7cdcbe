"""Tiers that ship with slide-core."""
