"""Test setup: 4 forced CPU devices (sharding tests need several; 8 on 2 cores can hang
XLA rendezvous), CPU platform, and quiet libraries."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
