"""chitu-ascend: the Huawei Ascend NPU backend of chitu-core (torch_npu's fused operators, HCCL).

Nothing here imports torch_npu when the package loads: the backend asks for it in ``is_available``
and the ops import it when they run, so a machine without CANN still lists the backend with its reason.
"""
