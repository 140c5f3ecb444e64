"""Per-framework adapters. Each subpackage imports only its own framework, lazily."""

from pitstop.adapters.registry import Adapter, StatefulAdapter, register_adapter, resolve

__all__ = ["Adapter", "StatefulAdapter", "register_adapter", "resolve"]
