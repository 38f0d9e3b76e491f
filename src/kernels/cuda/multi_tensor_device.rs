//! The kernels of `multi_tensor.cu` on a candle CUDA device: the pointer tables built from the
//! tensors' storage, uploaded with one host-to-device copy per launch, and the launches.
//!
//! **Writing many tensors in one launch.** candle has no multi-output custom op, and its
//! in-place ops take one tensor at a time. Here every tensor a launch touches is held by its
//! read guard (`storage_and_layout`, one per distinct storage) from the moment its pointer is
//! taken until the launches are enqueued, and the kernels write through the pointers of the
//! tensors they update in place: the f32 master and the half working copy of each parameter.
//! That is sound because (1) those are the optimizer's own state (a parameter's f32 Var and
//! working Var), which no graph aliases and which `Var::set` writes in place the same way;
//! (2) every write target has storage of its own, shared with no other tensor of the launch
//! (checked, or the caller keeps its composed ops), so no value is read and written by two
//! different records; (3) candle runs every op of a device on one stream, so whatever read
//! these values before is ordered before the kernel, and whatever reads them after, after it;
//! (4) no guard is held across a `Var::set` (which takes the write lock and would deadlock),
//! nor beyond this module's functions. Everything else a kernel writes is a fresh buffer
//! (master gradients, flags, new moments) that becomes a tensor only after the launch.

use std::collections::HashMap;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaStream, DevicePtr, PushKernelArg, SyncOnDrop};
use candle_core::cuda_backend::{CudaDevice, CudaStorageSlice, WrapErr};
use candle_core::op::BackpropOp;
use candle_core::{CudaStorage, DType, Device, Layout, Result, Storage, StorageRef, Tensor};

use super::{MtAdamW, MtKernel, MtLaunch, MtRecord, MtSgd, MtUnscale, SOURCE, mt_plan, type_code};
use crate::kernels::cuda::buffers::{config, offsets};
use crate::kernels::cuda::nvrtc::Kernels;

/// The kernels of `multi_tensor.cu`: NVRTC's PTX and the module loaded per device.
static KERNELS: Kernels = Kernels::new(
    "candle_amp_multi_tensor",
    SOURCE,
    "amp_mt_unscale_check",
    "multi-tensor optimizer",
    "the unscale and the optimizer step run",
);

/// Whether the kernels are loaded on `dev` (see [`Kernels::available`]).
pub(crate) fn available(dev: &CudaDevice) -> bool {
    KERNELS.available(dev)
}

/// The read guards of a launch's tensors, one per distinct storage.
struct Held<'t> {
    guards: Vec<StorageRef<'t>>,
}

impl<'t> Held<'t> {
    /// Holds the storage of every tensor of `ts` once, and returns with it each tensor's
    /// guard index. Every storage key is read before any guard is taken: a second read of a
    /// lock this thread already holds can deadlock behind a waiting writer (parking_lot's
    /// locks are fair).
    fn new(ts: &[&'t Tensor]) -> (Self, Vec<usize>) {
        let keys: Vec<usize> = ts.iter().map(|t| crate::kernels::storage_key(t)).collect();
        let mut index: HashMap<usize, usize> = HashMap::new();
        let mut guards = Vec::new();
        let ids = ts
            .iter()
            .zip(keys)
            .map(|(t, key)| {
                *index.entry(key).or_insert_with(|| {
                    guards.push(t.storage_and_layout().0);
                    guards.len() - 1
                })
            })
            .collect();
        (Self { guards }, ids)
    }
}

/// The device address of `l`'s first value in `s`, and what records the read when dropped.
fn address<'a>(s: &'a Storage, l: &Layout, stream: &'a CudaStream) -> Result<(u64, SyncOnDrop<'a>)> {
    let Storage::Cuda(cs) = s else {
        candle_core::bail!("amp-multi-tensor: a tensor off the CUDA device")
    };
    let (a, _) = offsets(l, "amp-multi-tensor")?;
    Ok(match &cs.slice {
        CudaStorageSlice::F32(x) => {
            let (p, g) = x.device_ptr(stream);
            (p + 4 * a as u64, g)
        }
        CudaStorageSlice::F16(x) => {
            let (p, g) = x.device_ptr(stream);
            (p + 2 * a as u64, g)
        }
        CudaStorageSlice::BF16(x) => {
            let (p, g) = x.device_ptr(stream);
            (p + 2 * a as u64, g)
        }
        _ => candle_core::bail!("amp-multi-tensor: a {:?} tensor", cs.dtype()),
    })
}

/// The CUDA device of `t` when the kernels are loaded there.
fn cuda_of(t: &Tensor) -> Option<&CudaDevice> {
    match t.device() {
        Device::Cuda(d) if KERNELS.available(d) => Some(d),
        _ => None,
    }
}

/// Whether `t` is a contiguous tensor of `n > 0` values of a kernel type on `dev`.
fn fits(t: &Tensor, dev: &Device, n: usize) -> bool {
    t.device().same_device(dev) && t.is_contiguous() && t.elem_count() == n && n > 0 && type_code(t.dtype()).is_some()
}

/// Enqueues `launches` of one kernel (tables uploaded one copy each); `unscale`: the flag
/// buffer and the arithmetic, the unscale kernel's arguments after `(table, count, chunk)`.
fn launch_all(dev: &CudaDevice, launches: &[MtLaunch], unscale: Option<(&CudaSlice<f32>, &MtUnscale)>) -> Result<()> {
    let ptx = KERNELS.ptx(dev).map_err(candle_core::Error::Msg)?;
    for l in launches {
        let func = dev.get_or_load_custom_func(l.kernel.name(), KERNELS.module, &ptx)?;
        let table: CudaSlice<u64> = dev.clone_htod(&l.table)?;
        let (count, chunk) = (l.count as i32, l.chunk as i64);
        let mut b = func.builder();
        b.arg(&table).arg(&count).arg(&chunk);
        if let Some((flags, u)) = unscale {
            b.arg(flags).arg(&u.mode).arg(&u.inv).arg(&u.div);
        }
        // SAFETY: the arguments match `AMP_MT_*_ARGS` in order and type; every record's
        // pointers address `n` values of its types in buffers held (or owned) by the caller
        // until the launch is enqueued, and the grid covers exactly the records' chunks.
        unsafe { b.launch(config(l.grid, l.block)) }.w()?;
        drop(b);
    }
    Ok(())
}

/// An f32 tensor of `shape` over a fresh buffer the kernel wrote whole.
fn wrap(s: CudaSlice<f32>, dev: &CudaDevice, shape: &[usize]) -> Tensor {
    let st = Storage::Cuda(CudaStorage::wrap_cuda_slice(s, dev.clone()));
    Tensor::from_storage(st, shape, BackpropOp::none(), false)
}

/// The device path's unscale and check for many raw gradients in one launch: for each
/// `(raw, acc)`, `Some((g, flag))` where the kernel made it (`g = [acc +] unscale(raw)`, f32,
/// of `acc`'s shape if there is one, else `raw`'s; `flag` a 0-d f32 view of the launch's flag
/// buffer, NaN if `g` holds an inf or NaN), `None` where the caller runs its composed ops
/// (another device or type, an empty or non-contiguous tensor, kernels not loaded).
pub(crate) fn unscale_check(items: &[(&Tensor, Option<&Tensor>)], scale: f32) -> Result<Vec<Option<(Tensor, Tensor)>>> {
    let mut out: Vec<Option<(Tensor, Tensor)>> = vec![None; items.len()];
    let Some((first, _)) = items.first() else {
        return Ok(out);
    };
    let Some(dev) = cuda_of(first) else {
        return Ok(out);
    };
    let device = first.device();
    let chosen: Vec<usize> = (0..items.len())
        .filter(|&i| {
            let (raw, acc) = items[i];
            let n = raw.elem_count();
            fits(raw, device, n) && acc.is_none_or(|a| a.dtype() == DType::F32 && fits(a, device, n))
        })
        .collect();
    if chosen.is_empty() {
        return Ok(out);
    }
    // SAFETY: each buffer is written whole by its record's blocks before anything reads it.
    let bufs: Vec<CudaSlice<f32>> = chosen
        .iter()
        .map(|&i| unsafe { dev.alloc::<f32>(items[i].0.elem_count()) })
        .collect::<Result<_>>()?;
    let flags = dev.alloc_zeros::<f32>(chosen.len())?;
    let stream = dev.cuda_stream();
    {
        // Each raw gradient, then its live sum if there is one.
        let ts: Vec<&Tensor> = chosen
            .iter()
            .flat_map(|&i| std::iter::once(items[i].0).chain(items[i].1))
            .collect();
        let (held, ids) = Held::new(&ts);
        let mut ids = ids.into_iter();
        let mut syncs = Vec::new();
        let mut records = Vec::with_capacity(chosen.len());
        for (k, &i) in chosen.iter().enumerate() {
            let (raw, acc) = items[i];
            let r = ids.next().unwrap_or_default();
            let (rp, s) = address(&held.guards[r], raw.layout(), &stream)?;
            syncs.push(s);
            let ap = match acc {
                Some(acc) => {
                    let a = ids.next().unwrap_or_default();
                    let (p, s) = address(&held.guards[a], acc.layout(), &stream)?;
                    syncs.push(s);
                    p
                }
                None => 0,
            };
            let (op, s) = bufs[k].device_ptr(&stream);
            syncs.push(s);
            let code = type_code(raw.dtype()).unwrap_or(0);
            records.push(MtRecord::unscale(rp, code, ap, op, raw.elem_count() as u64, k as u64));
        }
        let launches = mt_plan(MtKernel::UnscaleCheck, records);
        if launches.is_empty() {
            return Ok(out);
        }
        let u = MtUnscale::new(scale);
        launch_all(dev, &launches, Some((&flags, &u)))?;
        drop(syncs);
    }
    let flags = wrap(flags, dev, &[chosen.len()]);
    for (k, (i, buf)) in chosen.into_iter().zip(bufs).enumerate() {
        let (raw, acc) = items[i];
        let shape = acc.map_or(raw.dims(), |a| a.dims()).to_vec();
        out[i] = Some((wrap(buf, dev, &shape), flags.narrow(0, k, 1)?.squeeze(0)?));
    }
    Ok(out)
}

/// One parameter of a step launch.
pub(crate) struct StepItem<'a> {
    /// The f32 values updated in place (the master, or the f32 Var).
    pub param: &'a Tensor,
    /// Its f32 gradient.
    pub grad: &'a Tensor,
    /// The state buffers read (`None`: zeros, or none yet), f32.
    pub state_in: Vec<Option<&'a Tensor>>,
    /// The working copy written from the new values, if any.
    pub working: Option<&'a Tensor>,
}

/// Per-item constants and how many state buffers each writes.
enum Consts<'c> {
    AdamW(&'c [MtAdamW]),
    Sgd(&'c [MtSgd], bool),
}

/// Whether every item fits one launch: f32 parameters and gradients, f32 state, working copies
/// of a kernel type, all contiguous with the parameter's count on one device, and every write
/// target in storage shared with no other tensor of the launch.
fn steppable<'a>(items: &'a [StepItem<'a>]) -> Option<&'a CudaDevice> {
    let dev = cuda_of(items.first()?.param)?;
    let device = items[0].param.device();
    let mut writes = std::collections::HashSet::new();
    let mut reads = std::collections::HashSet::new();
    for it in items {
        let n = it.param.elem_count();
        let f32_fits = |t: &Tensor| t.dtype() == DType::F32 && fits(t, device, n);
        if !f32_fits(it.param)
            || !f32_fits(it.grad)
            || !it.state_in.iter().flatten().all(|t| f32_fits(t))
            || !it.working.is_none_or(|w| fits(w, device, n))
        {
            return None;
        }
        for w in std::iter::once(it.param).chain(it.working) {
            if !writes.insert(crate::kernels::storage_key(w)) {
                return None;
            }
        }
        for r in std::iter::once(it.grad).chain(it.state_in.iter().flatten().copied()) {
            reads.insert(crate::kernels::storage_key(r));
        }
    }
    writes.is_disjoint(&reads).then_some(dev)
}

fn step(items: &[StepItem<'_>], consts: Consts<'_>) -> Result<Option<Vec<Vec<Tensor>>>> {
    let Some(dev) = steppable(items) else {
        return Ok(None);
    };
    let (kernel, outs_per) = match consts {
        Consts::AdamW(_) => (MtKernel::AdamW, 2),
        Consts::Sgd(_, momentum) => (MtKernel::Sgd, usize::from(momentum)),
    };
    // SAFETY: each new state buffer is written whole by its record's blocks.
    let bufs: Vec<Vec<CudaSlice<f32>>> = items
        .iter()
        .map(|it| {
            (0..outs_per)
                .map(|_| unsafe { dev.alloc::<f32>(it.param.elem_count()) })
                .collect::<Result<_>>()
        })
        .collect::<Result<_>>()?;
    let stream = dev.cuda_stream();
    {
        // Per item: the parameter, the gradient, the state read, the working copy.
        let ts: Vec<&Tensor> = items
            .iter()
            .flat_map(|it| {
                [it.param, it.grad]
                    .into_iter()
                    .chain(it.state_in.iter().flatten().copied())
                    .chain(it.working)
            })
            .collect();
        let (held, flat) = Held::new(&ts);
        let mut flat = flat.into_iter();
        let mut next = || flat.next().unwrap_or_default();
        let ids: Vec<_> = items
            .iter()
            .map(|it| {
                let (p, g) = (next(), next());
                let s: Vec<Option<usize>> = it.state_in.iter().map(|t| t.map(|_| next())).collect();
                (p, g, s, it.working.map(|_| next()))
            })
            .collect();
        let mut syncs = Vec::new();
        let mut ptr = |i: usize, t: &Tensor| -> Result<u64> {
            let (p, s) = address(&held.guards[i], t.layout(), &stream)?;
            syncs.push(s);
            Ok(p)
        };
        let mut records = Vec::with_capacity(items.len());
        let mut out_ptrs = Vec::with_capacity(items.len());
        for (k, (it, (p, g, s, w))) in items.iter().zip(&ids).enumerate() {
            let pp = ptr(*p, it.param)?;
            let gp = ptr(*g, it.grad)?;
            let mut sp = Vec::new();
            for (id, t) in s.iter().zip(&it.state_in) {
                sp.push(match (id, t) {
                    (Some(id), Some(t)) => ptr(*id, t)?,
                    _ => 0,
                });
            }
            let (wp, wt) = match (w, it.working) {
                (Some(id), Some(t)) => (ptr(*id, t)?, type_code(t.dtype()).unwrap_or(0)),
                _ => (0, 0),
            };
            let n = it.param.elem_count() as u64;
            let st = |j: usize| sp.get(j).copied().unwrap_or(0);
            let ob: Vec<(u64, SyncOnDrop<'_>)> = bufs[k].iter().map(|b| b.device_ptr(&stream)).collect();
            let o = |j: usize| ob.get(j).map_or(0, |(p, _)| *p);
            records.push(match &consts {
                Consts::AdamW(c) => MtRecord::adamw(pp, gp, (st(0), st(1)), (o(0), o(1)), wp, wt, n, &c[k]),
                Consts::Sgd(c, _) => MtRecord::sgd(pp, gp, st(0), o(0), wp, wt, n, &c[k]),
            });
            out_ptrs.extend(ob);
        }
        let launches = mt_plan(kernel, records);
        if launches.is_empty() {
            return Ok(None);
        }
        launch_all(dev, &launches, None)?;
        drop(out_ptrs);
        drop(syncs);
    }
    Ok(Some(
        items
            .iter()
            .zip(bufs)
            .map(|(it, b)| b.into_iter().map(|b| wrap(b, dev, it.param.dims())).collect())
            .collect(),
    ))
}

/// AdamW over every item in one launch (per size cap): the masters (and working copies)
/// written in place, the new moments returned per item as `[exp_avg, exp_avg_sq]`; `Ok(None)`
/// where the kernel does not apply (nothing was written: the caller runs its tensor ops).
pub(crate) fn adamw_step(items: &[StepItem<'_>], consts: &[MtAdamW]) -> Result<Option<Vec<Vec<Tensor>>>> {
    if consts.len() != items.len() || items.iter().any(|i| i.state_in.len() != 2) {
        return Ok(None);
    }
    step(items, Consts::AdamW(consts))
}

/// SGD over every item in one launch (per size cap), as [`adamw_step`]: with `momentum` each
/// item returns its new momentum buffer (its `state_in[0]`: the old one, `None` at the first
/// step), without none.
pub(crate) fn sgd_step(items: &[StepItem<'_>], consts: &[MtSgd], momentum: bool) -> Result<Option<Vec<Vec<Tensor>>>> {
    if consts.len() != items.len() || items.iter().any(|i| i.state_in.len() != usize::from(momentum)) {
        return Ok(None);
    }
    step(items, Consts::Sgd(consts, momentum))
}
