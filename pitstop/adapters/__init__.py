"""Per-framework adapters. Each subpackage imports only its own framework, lazily."""

from .registry import Adapter, StatefulAdapter, register_adapter, resolve

__all__ = ["Adapter", "StatefulAdapter", "register_adapter", "resolve"]
