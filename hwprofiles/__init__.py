"""hwprofiles: what the hardware can do — datasheet presets and calibrated profiles.

Feeds the cost model. Only `calibrate` imports torch, lazily.
"""
