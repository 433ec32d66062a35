"""KV-page transfer between the prefill and decode meshes.

One small interface, `Connector`, chosen at construction; the workers never branch
on the backend.
"""
from transfer.connector import (Connector, KVHandoff, LayoutMismatchError, TransferError,
                                TransferStats, WireVersionError)
from transfer.device_put import DevicePutConnector

__all__ = ["Connector", "KVHandoff", "TransferStats", "TransferError", "WireVersionError",
           "LayoutMismatchError", "DevicePutConnector"]
