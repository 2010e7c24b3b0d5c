"""The hardware a rank runs on, read when Prometheus scrapes: memory, and its GPU from NVML.

:class:`HardwareCollector` is a Prometheus collector (registered by ``monitoring.Metrics``)
that reads, at each scrape, with the label ``rank``:

- device memory from torch's caching allocator (allocated, reserved, peak) and the
  device's used and total memory (``cudaMemGetInfo``, every process on the GPU): NaN on a
  rank without CUDA;
- this process's resident memory and its peak (``/proc/self/statm``, ``getrusage``), and
  its host's used and limit memory: the memory cgroup's limit and working set when one is
  set below the host's memory (a container, a Slurm job), else ``/proc/meminfo``'s
  ``MemTotal`` less ``MemAvailable``;
- the GPU's temperature, power, utilization and memory from NVML (the optional ``nvml``
  extra, ``nvidia-ml-py``, imported only on a CUDA rank): NaN and ``train_gpu_known 0``
  where NVML is absent or does not answer; a value NVML cannot read on this GPU (power on
  some boards) is NaN alone;
- ``train_gpu_info``: 1, labelled with the GPU's ``Hostname``, ``gpu`` (NVML's index, as
  dcgm-exporter's ``gpu``), ``UUID`` and ``modelName``, spelled as dcgm-exporter spells
  them, so rules and panels join the two on ``UUID`` (empty on a rank without a GPU).

Every family is there from the first scrape; nothing here raises into a scrape (a source
that fails reads NaN). The GPU source is any object with :class:`GpuSource`'s two members
(``identity``, ``read()``): :class:`NvmlGpu` on a GPU host.
"""

from __future__ import annotations

import logging
import os
import resource
import socket
from dataclasses import dataclass
from typing import Any, Iterator, Protocol

import torch
from prometheus_client.core import GaugeMetricFamily

__all__ = ["HardwareCollector", "GpuReading", "GpuSource", "NvmlGpu", "host_memory"]

log = logging.getLogger(__name__)
NAN = float("nan")
GPU_INFO_LABELS = ("Hostname", "gpu", "UUID", "modelName")  # dcgm-exporter's names


@dataclass(frozen=True)
class GpuReading:
    """One reading of a GPU; NaN where it could not be read."""

    temperature_celsius: float = NAN
    power_watts: float = NAN
    utilization_ratio: float = NAN
    memory_used_bytes: float = NAN


class GpuSource(Protocol):
    identity: dict[str, str]
    """``GPU_INFO_LABELS`` -> value: which GPU this is."""

    def read(self) -> GpuReading | None:
        """A reading, or None when the GPU cannot be read now."""


class NvmlGpu:
    """The GPU of a CUDA device, read through NVML (``pynvml`` from ``nvidia-ml-py``).

    :meth:`open` returns None where NVML is not installed or does not know the device (the
    exporter then says "unknown"); it never raises."""

    def __init__(self, nvml: Any, handle: Any, identity: dict[str, str]):
        self._nvml, self._handle, self.identity = nvml, handle, identity

    @classmethod
    def open(cls, device: torch.device) -> "NvmlGpu | None":
        try:
            import pynvml  # the optional 'nvml' extra; only on CUDA ranks
        except ImportError:
            log.info("GPU metrics unknown: nvidia-ml-py is not installed (pip install "
                     "'ckpt[nvml]')")
            return None
        try:
            pynvml.nvmlInit()
            uuid = _cuda_uuid(device)
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            name = pynvml.nvmlDeviceGetName(handle)
            identity = {"Hostname": socket.gethostname(),
                        "gpu": str(pynvml.nvmlDeviceGetIndex(handle)), "UUID": uuid,
                        "modelName": name.decode() if isinstance(name, bytes) else str(name)}
        except Exception as exc:  # noqa: BLE001 - NVML errors are its own classes
            log.warning("GPU metrics unknown: NVML does not answer for %s: %s", device, exc)
            return None
        return cls(pynvml, handle, identity)

    def read(self) -> GpuReading | None:
        nvml, h = self._nvml, self._handle

        def get(fn) -> float:
            try:
                return float(fn())
            except Exception:  # noqa: BLE001 - e.g. NVMLError_NotSupported for one field
                return NAN

        return GpuReading(
            temperature_celsius=get(lambda: nvml.nvmlDeviceGetTemperature(
                h, nvml.NVML_TEMPERATURE_GPU)),
            power_watts=get(lambda: nvml.nvmlDeviceGetPowerUsage(h) / 1000.0),
            utilization_ratio=get(lambda: nvml.nvmlDeviceGetUtilizationRates(h).gpu / 100.0),
            memory_used_bytes=get(lambda: nvml.nvmlDeviceGetMemoryInfo(h).used))


def _cuda_uuid(device: torch.device) -> str:
    """NVML's spelling (``GPU-<uuid>``) of a CUDA device's UUID (CUDA_VISIBLE_DEVICES may
    renumber devices; the UUID does not change)."""
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"


# -- host memory ------------------------------------------------------------------------------
def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
        return None if text == "max" else int(text)
    except (OSError, ValueError):
        return None


def _cgroup_memory(proc: str = "/proc", sys_fs: str = "/sys/fs/cgroup"
                   ) -> tuple[int, int] | None:
    """``(used, limit)`` of this process's memory cgroup when it has a limit (v2, else v1);
    used is its working set (usage less inactive file pages, as kubelet counts it)."""
    try:
        with open(f"{proc}/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2
            base = f"{sys_fs}{path.rstrip('/')}"
            files = (f"{base}/memory.max", f"{base}/memory.current", f"{base}/memory.stat",
                     "inactive_file")
        elif "memory" in controllers.split(","):
            base = f"{sys_fs}/memory{path.rstrip('/')}"
            if not os.path.exists(base):  # a container sees its own cgroup at the root
                base = f"{sys_fs}/memory"
            files = (f"{base}/memory.limit_in_bytes", f"{base}/memory.usage_in_bytes",
                     f"{base}/memory.stat", "total_inactive_file")
        else:
            continue
        limit, usage = _read_int(files[0]), _read_int(files[1])
        if limit is None or usage is None:
            continue
        inactive = 0
        try:
            with open(files[2]) as f:
                for row in f:
                    key, _, value = row.partition(" ")
                    if key == files[3]:
                        inactive = int(value)
        except (OSError, ValueError):
            pass
        return max(0, usage - inactive), limit
    return None


def _meminfo(proc: str = "/proc") -> dict[str, int]:
    out = {}
    try:
        with open(f"{proc}/meminfo") as f:
            for row in f:
                key, _, rest = row.partition(":")
                out[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def host_memory(proc: str = "/proc", sys_fs: str = "/sys/fs/cgroup") -> tuple[float, float]:
    """``(used, limit)`` bytes of this process's host: its memory cgroup when that has a
    limit below the host's memory, else the host's (``MemTotal - MemAvailable``,
    ``MemTotal``); NaN where neither reads. ``proc`` and ``sys_fs``: where ``/proc`` and the
    cgroup file system are mounted."""
    info = _meminfo(proc)
    total = info.get("MemTotal")
    cgroup = _cgroup_memory(proc, sys_fs)
    if cgroup is not None and (total is None or cgroup[1] < total):
        return float(cgroup[0]), float(cgroup[1])
    if total is None or "MemAvailable" not in info:
        return NAN, NAN
    return float(total - info["MemAvailable"]), float(total)


def _rss_bytes() -> float:
    try:
        with open("/proc/self/statm") as f:
            return float(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError, IndexError):
        return NAN


def _peak_rss_bytes() -> float:
    # ru_maxrss: KiB on Linux
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


# -- the collector ----------------------------------------------------------------------------
class HardwareCollector:
    """The hardware series of one rank (see the module docstring), read at each scrape.

    ``device``: the rank's torch device (CUDA: its allocator and memory are read); ``gpu``:
    its GPU source (default on CUDA: :meth:`NvmlGpu.open`; None: unknown)."""

    def __init__(self, rank: str, device: torch.device | str | None = None,
                 gpu: GpuSource | None = None):
        self.rank = rank
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        if gpu is None and self.cuda:
            gpu = NvmlGpu.open(self.device)
        self.gpu = gpu

    def describe(self) -> list:
        return []  # families are made at each collect; none known at registration

    def collect(self) -> Iterator[GaugeMetricFamily]:
        rk = self.rank

        def gauge(name: str, doc: str, value: float, labels: dict[str, str] | None = None):
            labels = {"rank": rk, **(labels or {})}
            g = GaugeMetricFamily(name, doc, labels=list(labels))
            g.add_metric(list(labels.values()), value)
            return g

        allocated = reserved = peak = dev_used = dev_total = NAN
        if self.cuda:
            try:
                allocated = float(torch.cuda.memory_allocated(self.device))
                reserved = float(torch.cuda.memory_reserved(self.device))
                peak = float(torch.cuda.max_memory_allocated(self.device))
                free, total = torch.cuda.mem_get_info(self.device)
                dev_used, dev_total = float(total - free), float(total)
            except Exception as exc:  # noqa: BLE001 - a scrape never fails on this
                log.debug("device memory unreadable: %s", exc)
        yield gauge("train_device_memory_allocated_bytes",
                    "Device memory in tensors (torch allocator); NaN without CUDA", allocated)
        yield gauge("train_device_memory_reserved_bytes",
                    "Device memory the torch allocator holds; NaN without CUDA", reserved)
        yield gauge("train_device_memory_peak_bytes",
                    "Peak device memory in tensors since the process started; NaN without "
                    "CUDA", peak)
        host_used, host_limit = host_memory()
        rss = _rss_bytes()
        yield gauge("train_host_memory_rss_bytes", "Resident memory of this process", rss)
        # The kernel's high-water mark lags the current size a little; never below it.
        yield gauge("train_host_memory_peak_bytes", "Peak resident memory of this process",
                    max(_peak_rss_bytes(), rss) if rss == rss else _peak_rss_bytes())
        used = GaugeMetricFamily("train_memory_used_bytes",
                                 "Memory in use on this rank's device (every process on the "
                                 "GPU; NaN without CUDA) and host (its memory cgroup's working "
                                 "set, else MemTotal - MemAvailable), by memory",
                                 labels=["rank", "memory"])
        limit = GaugeMetricFamily("train_memory_limit_bytes",
                                  "The memory there is: the device's total, the host's (its "
                                  "memory cgroup's limit, else MemTotal), by memory",
                                  labels=["rank", "memory"])
        for memory, u, lim in (("device", dev_used, dev_total), ("host", host_used, host_limit)):
            used.add_metric([rk, memory], u)
            limit.add_metric([rk, memory], lim)
        yield used
        yield limit
        reading = None
        if self.gpu is not None:
            try:
                reading = self.gpu.read()
            except Exception as exc:  # noqa: BLE001
                log.debug("GPU unreadable: %s", exc)
        r = reading or GpuReading()
        yield gauge("train_gpu_known", "1: NVML answered for this rank's GPU; 0: unknown (no "
                    "GPU, no nvidia-ml-py, or no answer): the train_gpu_ series read NaN",
                    1.0 if reading is not None else 0.0)
        yield gauge("train_gpu_temperature_celsius", "GPU temperature (NVML); NaN: unknown",
                    r.temperature_celsius)
        yield gauge("train_gpu_power_watts", "GPU power draw (NVML); NaN: unknown",
                    r.power_watts)
        yield gauge("train_gpu_utilization_ratio", "Share of the last sample period a kernel "
                    "ran on the GPU, 0-1 (NVML); NaN: unknown", r.utilization_ratio)
        yield gauge("train_gpu_memory_used_bytes", "GPU memory in use, every process (NVML); "
                    "NaN: unknown", r.memory_used_bytes)
        identity = self.gpu.identity if self.gpu is not None else {}
        yield gauge("train_gpu_info", "1, labelled with this rank's GPU as dcgm-exporter names "
                    "it (Hostname, gpu, UUID, modelName; empty without a GPU)", 1.0,
                    {label: str(identity.get(label, socket.gethostname()
                                             if label == "Hostname" else ""))
                     for label in GPU_INFO_LABELS})

