"""The AttnSlice IR: slices, masks and the passes over them."""

from maskc.ir.mask import Mask
from maskc.ir.slices import TYPE_IDS, TYPE_NAMES, AttnSlice, AttnType, band_slices, slice_areas

__all__ = ["AttnSlice", "AttnType", "Mask", "TYPE_IDS", "TYPE_NAMES", "band_slices", "slice_areas"]
