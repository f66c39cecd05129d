"""A device-only shim that lets NVRx 0.7.0's local checkpointing run on CPU (bench harness only, never the product).

``nvidia_resiliency_ext.checkpointing.local`` assumes CUDA in four places; nothing else in it depends on the
device. ``install()`` replaces exactly those, at runtime, without editing NVRx's files:

1. ``BasicTensorAwareStateDict.__init__`` asserts every tensor ``is_cuda``: the same constructor without the assert.
2. ``BasicTensorAwareStateDict.restore_tensor_device`` moves a loaded state to ``"cuda"``: it moves it to ``"cpu"``.
3. ``GroupWrapper.isend_state_dict`` sends ``ten.cuda()`` (and its receiving half, ``irecv_state_dict``, receives
   into ``torch.empty_like(ten, device="cuda")`` when the placeholder is on CPU): both send and receive the CPU
   tensors themselves, as gloo does.
4. ``torch.cuda.synchronize()`` before an async save returns (the device-to-host copy it waits for is a CPU copy
   here): ``BaseCheckpointManager.save`` sees a no-op ``synchronize`` on a CPU-only machine.

Replication (``CliqueReplicationStrategy`` over gloo), file layout, ``find_latest`` and the restore plan are NVRx's
own code, untouched. The bench names this shim in its output (``NAME``); importing this module imports no torch.
"""

NAME = "NVRx device-only CPU shim (tests/bench/nvrx_device_shim.py: 4 CUDA device calls -> CPU)"


def install() -> None:
    """Patches the four device calls; idempotent."""
    import torch
    import torch.distributed as dist
    from nvidia_resiliency_ext.checkpointing.local import basic_state_dict
    from nvidia_resiliency_ext.checkpointing.local.replication import group_utils

    state_dict_class = basic_state_dict.BasicTensorAwareStateDict
    if getattr(state_dict_class, "_mtc_cpu_shim", False):
        return

    def __init__(self, state_dict):  # 1: NVRx's constructor without the is_cuda assert
        self.state_dict = state_dict
        self._is_hollow = False

    def restore_tensor_device(self, non_blocking=True):  # 2: "cuda" -> "cpu"
        assert not self.is_hollow
        basic_state_dict.dict_list_map_inplace(
            lambda x: x.to("cpu", non_blocking=non_blocking) if isinstance(x, torch.Tensor) else x, self.state_dict
        )

    def isend_state_dict(self, state_dict, dst):  # 3: NVRx's body without ten.cuda()
        tensor_data = state_dict.pop_tensors()
        log_data = {"data_sent": sum(ten.nbytes for ten in tensor_data)}
        self.send_object(state_dict, dst)
        for ten in tensor_data:
            dist.send(ten, dst, group=self.group)
        state_dict.insert_tensors(tensor_data)
        return log_data

    def irecv_state_dict(self, src):  # 3, receiving half: NVRx's body, receiving into the CPU tensor itself
        hollow_ckpt = self.recv_object(src)
        hollow_ckpt.init_tensors()
        for ten in hollow_ckpt.tensors:
            dist.recv(ten, src, group=self.group)
        return hollow_ckpt, {"data_recv": sum(ten.nbytes for ten in hollow_ckpt.tensors)}

    state_dict_class.__init__ = __init__
    state_dict_class.restore_tensor_device = restore_tensor_device
    group_utils.GroupWrapper.isend_state_dict = isend_state_dict
    group_utils.GroupWrapper.irecv_state_dict = irecv_state_dict
    if not torch.cuda.is_available():  # 4: the D2H wait before an async save returns
        torch.cuda.synchronize = lambda device=None: None
    state_dict_class._mtc_cpu_shim = True
