"""Shared plumbing of the tinypost trainers: data, models, rollouts, verifiers, logging, torchrun helpers.

Plain modules of plain functions; each trainer file imports what it needs from here.
"""
