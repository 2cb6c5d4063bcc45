"""The fleet simulator (`kvfleet sim`): the router's real policies and indexes over simulated engines that use
the engine's real block pool, with step times from a calibrated cost model (cost.py)."""
