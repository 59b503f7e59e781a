"""Triton kernels: the GPU path, one kernel per module, each behind a checking wrapper.

``store_kv``, ``decode_attention`` (split-K, GQA-grouped), ``extend_attention`` and
``rms_norm``; ``paged`` holds the device helpers the attention kernels share and
``checks`` the host-side argument checks. Nothing is imported here, so importing the
package does not import Triton; ``kernels.dispatch`` imports a module on first use.
"""
