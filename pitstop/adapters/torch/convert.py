"""The torch converters where PyTorch users import them (``docs/torch.md``,
``docs/security.md``); they live in :mod:`pitstop.interop` with the other formats'."""

from __future__ import annotations

from pitstop.interop.dcp import DCP_METADATA_GLOBALS, import_dcp, read_dcp_metadata
from pitstop.interop.torch_save import export_safetensors, export_torch_save, import_torch_save

__all__ = ["import_torch_save", "import_dcp", "export_torch_save", "export_safetensors",
           "read_dcp_metadata", "DCP_METADATA_GLOBALS"]
