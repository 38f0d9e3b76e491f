//! Profiling aid (`BENCH_OPS=1`): each of the library's element-wise ops, forward and
//! forward plus backward, on a 512 x 1024 tensor per type, at the tier `--isa` picks. It
//! shows which kernel a tier leaves slow; the step figures stay the bench's measure.

use anyhow::Result;
use candle_amp::{kernels, ops};
use candle_core::{DType, Device, Tensor, Var};

use crate::measure::median_s;

/// Prints one line per op and type to stderr: forward ms, forward + backward ms.
pub fn op_times(reps: usize) -> Result<()> {
    let dev = Device::Cpu;
    let shape = (512, 1024);
    type Op = fn(&Tensor, &Tensor) -> candle_core::Result<Tensor>;
    // "none" is the harness alone (cast to f32, sum, their backward and the variable's
    // gradient):
    // subtract it from the others' forward plus backward.
    let all: [(&str, Op); 7] = [
        ("none", |x, _| Ok(x.clone())),
        ("relu", |x, _| ops::relu(x)),
        ("gelu", |x, _| ops::gelu(x)),
        ("layer_norm", |x, w| ops::layer_norm(x, Some(w), None, 1e-5)),
        ("softmax", |x, _| kernels::scaled_softmax(x, 0.125, false, x.dtype())),
        ("add", |x, _| ops::add(x, x)),
        ("cast_f32", |x, _| kernels::cast(x, DType::F32)),
    ];
    for dt in [DType::F32, DType::BF16, DType::F16] {
        let x = Var::from_tensor(&Tensor::randn(0f32, 1., shape, &dev)?.to_dtype(dt)?)?;
        let w = Var::from_tensor(&Tensor::ones(1024, dt, &dev)?)?;
        for (name, f) in all {
            let fwd = median_s(reps, || {
                std::hint::black_box(f(x.as_tensor(), w.as_tensor())?);
                Ok(())
            })?;
            let both = median_s(reps, || {
                let y = f(x.as_tensor(), w.as_tensor())?;
                std::hint::black_box(kernels::cast(&y, DType::F32)?.sum_all()?.backward()?);
                Ok(())
            })?;
            eprintln!(
                "{name:>10} {dt:?}: fwd {:.3} ms, fwd+bwd {:.3} ms",
                fwd * 1e3,
                both * 1e3
            );
        }
    }
    Ok(())
}
