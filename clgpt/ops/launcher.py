"""The launcher: the one place in clgpt where a kernel is enqueued, and what it launches into.

One Launcher per Ops (one device, one model's widths) owns:
    kernels   the programs built for it (`kernel`: Device.kernel with NVIDIA's verbose build log where asked) and
              the table `k` of kernels launched by name (`run`, `runp`)
    launches  `launch` (a kernel object with its sizes and arguments), with the preset plan cache: on devices
              whose tuning row sets `preset`, a cl.Kernel kept per (kernel, sizes, buffers) whose arguments were
              set once, so a repeated launch is one enqueue
    buffers   `buf` (fp32), `bytes_buf`, scratch grown as asked (`grown`, `scratch`, `slot`), sub-buffers at an
              offset (`sub`) and the two halves of a buffer (`halves`)

Every other file of clgpt/ops/, and clgpt/inference/kvcache.py, launches through these public methods: the
kernels of every kernels/*.cl file the others name (kernels/matmul.cl, kernels/attention.cl, ...) and
kernels/gemv.cl's decode kernels.
"""

from __future__ import annotations

from operator import itemgetter

import numpy as np
import pyopencl as cl

from clgpt.device.opencl import Device
from clgpt.errors import ClgptError

F32 = 4
PLANS_MAX = 4096  # preset launches kept before the cache starts over (a model's steps use a few hundred)


def ceil_to(a: int, b: int) -> int:
    return (a + b - 1) // b * b


class Launcher:
    """Kernels, launches and buffers of one device (see the module doc).

    launch_row: the clgpt.device.tuning row (local_1d, local_2d); preset: launch through kept cl.Kernels;
    row_groups_of_one: `rows` launches one work-item a work-group (CPUs); nv_verbose: NVIDIA build logs with
    registers and spills (bench/gpu_tc.py)."""

    def __init__(self, dev: Device, launch_row: dict, preset: bool, row_groups_of_one: bool, nv_verbose: bool):
        self.dev, self.ctx, self.queue = dev, dev.ctx, dev.queue
        self.local_1d, self.local_2d = (launch_row["local_1d"],), tuple(launch_row["local_2d"])
        self.preset, self.row_groups_of_one, self.nv_verbose = preset, row_groups_of_one, nv_verbose
        self.align = max(64, dev.device.mem_base_addr_align // 8 // F32)  # sub-buffer alignment, in floats
        self.k = {}  # kernels launched by name
        self._plans = {}  # preset launches: (kernel, gsize, lsize, buffers) -> [a cl.Kernel, the args it holds]
        self._buffer_args = {}  # kernel -> a function picking its non-scalar arguments (the plans' key)
        self._scratch, self._scratch_size = {}, {}  # fp32 scratch by slot (scratch)
        self._slots, self._slot_size = {}, {}  # byte scratch by slot (slot)
        self._grown = {}  # scratch floats by name (grown)
        self._subs = {}  # sub-buffers by (buffer, offset)
        self._halves = {}  # (buffer, n) -> its two views

    # ---- programs ----
    def kernel(self, stem: str, name: str, build_options=(), verbose_opts: dict | None = None, **defines):
        """Device.kernel(stem, name, ...); with `verbose_opts` (the -D options deciding it) NVIDIA's compiler reports
        registers and spills in the build log where the knob asks and the kernel is not emulated (MMA_EMULATE)."""
        if verbose_opts is not None:
            build_options = tuple(build_options) + self.verbose_options(verbose_opts)
        return self.dev.kernel(stem, name, build_options=build_options, **defines)

    def verbose_options(self, opts: dict) -> tuple:
        """Build options: -cl-nv-verbose where the knob asks, not for kernels built with MMA_EMULATE in `opts`."""
        return ("-cl-nv-verbose",) if self.nv_verbose and not opts.get("MMA_EMULATE") else ()

    # ---- launches ----
    def run(self, name, gsize, *args, lsize=None):
        """Kernel `name` of the table over gsize (local size lsize, None: the runtime's)."""
        self.launch(self.k[name], gsize, lsize, args)

    def runp(self, name, gsize, *args):
        """run with the device's fixed local size, the global size padded to it (the kernel bounds-checks).
        A fixed local size matters on PoCL: it compiles a kernel once per local size, and lets it pick one
        that divides the global size when none is given, so a size that changes per call (distinct tokens,
        T') would compile again and again."""
        lsize = self.local_1d if len(gsize) == 1 else self.local_2d
        self.launch(self.k[name], tuple(ceil_to(g, l) for g, l in zip(gsize, lsize)), lsize, args)

    def rows(self, name, N, args):
        """A one-work-item-per-row kernel over N work-items: CPUs one work-item a work-group (explicit vector loops,
        as the CPU forms' float8 kernels are launched; so that a few, LayerNorm's dw, db at C / norm_cb, still spread
        over the cores), other devices the fixed 1-D local size."""
        if self.row_groups_of_one:
            self.run(name, (N,), *args, lsize=(1,))
        else:
            self.runp(name, (N,), *args)

    def launch(self, kern, gsize, lsize, args):
        """kern(queue, gsize, lsize, *args); with `preset`, through a cl.Kernel kept per (kernel, sizes, buffers)
        whose arguments were set once: a repeated launch (every step of training) is one enqueue, and one whose
        scalars change every step (a dropout seed, AdamW's bias corrections) sets them again on the same
        cl.Kernel instead of making a new one each step."""
        if not self.preset or not isinstance(kern, cl.Kernel):
            kern(self.queue, gsize, lsize, *args)
            return
        ptr = kern.int_ptr
        buffers = self._buffer_args.get(ptr)  # the kernel's non-scalar arguments (buffers, None), by position
        if buffers is None:
            pos = tuple(i for i, a in enumerate(args) if not isinstance(a, np.generic))
            buffers = self._buffer_args[ptr] = (itemgetter(*pos) if len(pos) > 1 else
                                                 (lambda a, i=pos[0]: a[i]) if pos else (lambda a: ()))
        key = (ptr, tuple(gsize), lsize and tuple(lsize), buffers(args))
        try:
            plan = self._plans.get(key)
        except TypeError:  # an unhashable argument: launch it plainly
            kern(self.queue, gsize, lsize, *args)
            return
        if plan is None:
            if len(self._plans) >= PLANS_MAX:
                self._plans.clear()
            plan = self._plans[key] = [cl.Kernel(kern.program, kern.function_name), None]
        if plan[1] != args:
            plan[0].set_args(*args)
            plan[1] = args
        cl.enqueue_nd_range_kernel(self.queue, plan[0], gsize, lsize)

    def launch_set(self, kern: cl.Kernel, gsize, lsize):
        """A cl.Kernel whose arguments its owner set once (kvcache's decode plans)."""
        cl.enqueue_nd_range_kernel(self.queue, kern, gsize, lsize)

    def launch_plain(self, kern, gsize, lsize, args):
        """kern(queue, gsize, lsize, *args) never through a plan: launches whose scalars change every call."""
        kern(self.queue, gsize, lsize, *args)

    # ---- buffers ----
    def buf(self, nfloats: int) -> cl.Buffer:
        return cl.Buffer(self.ctx, cl.mem_flags.READ_WRITE, max(1, int(nfloats)) * F32)

    def bytes_buf(self, nbytes: int) -> cl.Buffer:
        return cl.Buffer(self.ctx, cl.mem_flags.READ_WRITE, int(nbytes))

    def grown(self, key, n):
        """Scratch floats named `key`, grown to at least n (the contents do not survive a growth)."""
        buf = self._grown.get(key)
        if buf is None or buf.size < n * F32:
            buf = self._grown[key] = self.buf(n)
        return buf

    def scratch(self, slot, n):
        """fp32 scratch `slot`, grown to at least n floats: as grown, sized by what it holds rather than bytes."""
        if self._scratch_size.get(slot, 0) < n:
            self._scratch[slot], self._scratch_size[slot] = self.buf(n), n
        return self._scratch[slot]

    def slot(self, slot, nbytes):
        """Byte scratch `slot` (the bf16 operand copies), grown to at least nbytes."""
        if self._slot_size.get(slot, 0) < nbytes:
            self._slots[slot], self._slot_size[slot] = self.bytes_buf(nbytes), nbytes
        return self._slots[slot]

    def sub(self, buf, off):
        """The sub-buffer of buf from float `off` on (kept: the same few every step, so preset launches hit)."""
        if off == 0:
            return buf
        key = (buf.int_ptr, off)
        sub = self._subs.get(key)
        if sub is None:
            parent = buf.get_info(cl.mem_info.ASSOCIATED_MEMOBJECT)  # a sub-buffer's: regions of the parent
            base = buf.get_info(cl.mem_info.OFFSET) if parent is not None else 0
            sub = self._subs[key] = (parent or buf).get_sub_region(base + off * F32, buf.size - off * F32)
        return sub

    def halves(self, buf, n):
        """(first, second): views of buf's floats 0..n-1 and n..2n-1, made once; n a multiple of self.align."""
        key = (buf.int_ptr, n)
        views = self._halves.get(key)
        if views is None:
            if n % self.align:
                raise ClgptError(f"internal: a view at float {n} is off the device's sub-buffer alignment "
                                 f"({self.align} floats)")
            views = self._halves[key] = (buf.get_sub_region(0, n * F32), buf.get_sub_region(n * F32, n * F32))
        return views
