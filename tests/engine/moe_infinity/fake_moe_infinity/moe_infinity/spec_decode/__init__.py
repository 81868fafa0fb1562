"""Fake ``moe_infinity.spec_decode``: the DFlash speculator and its route-ahead recorders."""

from moe_infinity.spec_decode._route_ahead_stats import RouteAheadStats, RouteUnionCollector
from moe_infinity.spec_decode.dflash import DFlashConfig, DFlashSpeculator, NativeStepTrace

__all__ = ["DFlashConfig", "DFlashSpeculator", "NativeStepTrace", "RouteAheadStats", "RouteUnionCollector"]
