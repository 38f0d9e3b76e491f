//! Per-tensor statistics in one pass: the numbers Transformer Engine's `LogTensorStats` and
//! `LogFp8TensorStats` report, for the half types this crate uses.
//!
//! On the CPU one pass over the tensor's contiguous f32, f16 or bf16 values (a
//! non-contiguous tensor is copied to a contiguous one first) computes every field, in f32
//! for the values and f64 for the sums. On other devices (and on the run's device path) the
//! same fields, the binade histogram included, are computed with candle ops on the tensor's
//! device into one vector ([`device_vector`]); the recorder reads all of a step's vectors in
//! one transfer.

use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};

use crate::error::Result;

/// f16's smallest normal magnitude, 2^-14: below it values are subnormal or flush to zero.
pub const F16_MIN_NORMAL: f64 = 6.103_515_625e-5;
/// f16's largest finite magnitude.
pub const F16_MAX: f64 = 65504.0;
/// bf16's smallest normal magnitude, 2^-126 (f32's).
pub const BF16_MIN_NORMAL: f64 = 1.175_494_350_822_287_5e-38;

/// Buckets of the binade histogram: one per f32 biased exponent (0: f32 subnormals).
pub(crate) const BINADES: usize = 255;

/// The statistics of one tensor. Fractions are of all its elements; magnitudes are of its
/// finite values.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TensorStats {
    /// The type it ran in (`"f32"`, `"f16"`, `"bf16"`, ...).
    pub dtype: String,
    /// Number of elements.
    pub elements: u64,
    /// Largest finite magnitude (0 when there is none).
    pub amax: f64,
    /// Smallest nonzero finite magnitude (0 when there is none).
    pub amin_nonzero: f64,
    /// Mean magnitude of the finite values (0 when there is none).
    pub mean_abs: f64,
    /// Fraction of exact zeros.
    pub zero_frac: f64,
    /// Fraction of nonzero finite values that, times `scale`, lie below f16's smallest
    /// normal (they are subnormal in f16, or flush to zero).
    pub underflow_f16: f64,
    /// The same for bf16's smallest normal.
    pub underflow_bf16: f64,
    /// Fraction of values that, times `scale`, lie above f16's largest finite value
    /// (infinities included).
    pub overflow_f16: f64,
    /// Count of inf and NaN values.
    pub nonfinite: u64,
    /// Dynamic range in binades: `log2(amax) - log2(amin_nonzero)` (0 without nonzero
    /// values).
    pub range_binades: f64,
    /// The multiplier applied before the comparisons with the half types' limits (the loss
    /// scale for unscaled gradients, else 1).
    pub scale: f64,
}

/// What one pass accumulates.
#[derive(Debug, Clone)]
pub(crate) struct Acc {
    pub n: u64,
    pub nan: u64,
    pub inf: u64,
    pub zeros: u64,
    pub under16: u64,
    pub underbf: u64,
    pub over16: u64,
    pub amax: f32,
    pub amin: f32,
    pub sum: f64,
    /// Nonzero finite values by f32 biased exponent (`Some` when asked for).
    pub binades: Option<Vec<u64>>,
}

impl Acc {
    fn new(binades: bool) -> Self {
        Self {
            n: 0,
            nan: 0,
            inf: 0,
            zeros: 0,
            under16: 0,
            underbf: 0,
            over16: 0,
            amax: 0.0,
            amin: f32::INFINITY,
            sum: 0.0,
            binades: binades.then(|| vec![0; BINADES]),
        }
    }

    /// Folds a block of values in (f32 arithmetic for the values, f64 for the sum and the
    /// comparisons with the limits).
    #[inline]
    fn block(&mut self, xs: &[f32], scale: f64) {
        let (t16, tbf, o16) = (F16_MIN_NORMAL / scale, BF16_MIN_NORMAL / scale, F16_MAX / scale);
        let mut sum = 0f64;
        for &v in xs {
            let a = v.abs();
            if a.is_nan() {
                self.nan += 1;
                continue;
            }
            if a == f32::INFINITY {
                self.inf += 1;
                continue;
            }
            let d = a as f64;
            sum += d;
            if a > self.amax {
                self.amax = a;
            }
            if a == 0.0 {
                self.zeros += 1;
                continue;
            }
            if a < self.amin {
                self.amin = a;
            }
            self.under16 += (d < t16) as u64;
            self.underbf += (d < tbf) as u64;
            self.over16 += (d > o16) as u64;
            if let Some(h) = &mut self.binades {
                h[((a.to_bits() >> 23) & 0xff) as usize] += 1;
            }
        }
        self.sum += sum;
        self.n += xs.len() as u64;
    }

    fn finish(self, dtype: DType, scale: f64) -> (TensorStats, Option<Vec<u64>>) {
        let n = self.n.max(1) as f64;
        let finite = self.n - self.nan - self.inf;
        let has_nz = self.amin.is_finite();
        let amin = if has_nz { self.amin as f64 } else { 0.0 };
        let amax = self.amax as f64;
        let stats = TensorStats {
            dtype: dtype.as_str().to_string(),
            elements: self.n,
            amax,
            amin_nonzero: amin,
            mean_abs: if finite > 0 { self.sum / finite as f64 } else { 0.0 },
            zero_frac: self.zeros as f64 / n,
            underflow_f16: self.under16 as f64 / n,
            underflow_bf16: self.underbf as f64 / n,
            overflow_f16: (self.over16 + self.inf) as f64 / n,
            nonfinite: self.nan + self.inf,
            range_binades: if has_nz { amax.log2() - amin.log2() } else { 0.0 },
            scale,
        };
        (stats, self.binades)
    }
}

pub(crate) fn check_scale(scale: f32) -> Result<f64> {
    if !(scale.is_finite() && scale > 0.0) {
        return Err(crate::error::AmpError::InvalidArgument {
            argument: "scale",
            reason: format!("the statistics' scale must be finite and > 0, got {scale}"),
        });
    }
    Ok(scale as f64)
}

impl TensorStats {
    /// The statistics of `t` (any shape and layout; f32, f16, bf16 or f64), its values
    /// multiplied by `scale` before they are compared with f16's and bf16's limits (pass the
    /// loss scale for unscaled gradients, else 1). Non-floating tensors and a scale that is
    /// not finite and positive are an [`crate::AmpError`].
    ///
    /// ```
    /// use candle_amp::doctor::TensorStats;
    /// use candle_core::{Device, Tensor};
    /// # fn main() -> anyhow::Result<()> {
    /// let t = Tensor::new(&[0f32, 1e-6, 2.0, 1e5, f32::NAN], &Device::Cpu)?;
    /// let s = TensorStats::of(&t, 1.0)?;
    /// assert_eq!((s.amax, s.nonfinite), (1e5, 1));
    /// assert_eq!(s.zero_frac, 0.2);
    /// assert_eq!(s.underflow_f16, 0.2);       // 1e-6 is subnormal in f16
    /// assert_eq!(s.overflow_f16, 0.2);        // 1e5 > 65504
    /// assert_eq!(s.amin_nonzero, 1e-6f32 as f64);
    /// # Ok(()) }
    /// ```
    pub fn of(t: &Tensor, scale: f32) -> Result<TensorStats> {
        Ok(compute(t, scale, false)?.0)
    }
}

/// The statistics and, with `binades`, the histogram of nonzero finite magnitudes by f32
/// biased exponent.
pub(crate) fn compute(t: &Tensor, scale: f32, binades: bool) -> Result<(TensorStats, Option<Vec<u64>>)> {
    let scale = check_scale(scale)?;
    let dtype = t.dtype();
    if !dtype.is_float() {
        return Err(crate::error::AmpError::InvalidArgument {
            argument: "tensor",
            reason: format!("statistics need a floating tensor, got {dtype:?}"),
        });
    }
    if !matches!(t.device(), Device::Cpu) {
        return on_device(t, scale, binades);
    }
    let t = if t.is_contiguous() { t.clone() } else { t.contiguous()? };
    let mut acc = Acc::new(binades);
    let (storage, layout) = t.storage_and_layout();
    let Some((start, end)) = layout.contiguous_offsets() else {
        drop(storage);
        return on_device(&t, scale, binades);
    };
    const BLOCK: usize = 1024;
    match &*storage {
        candle_core::Storage::Cpu(cpu) => match cpu {
            candle_core::CpuStorage::F32(v) => {
                for c in v[start..end].chunks(BLOCK) {
                    acc.block(c, scale);
                }
            }
            candle_core::CpuStorage::F16(v) => {
                let mut buf = [0f32; BLOCK];
                for c in v[start..end].chunks(BLOCK) {
                    half::slice::HalfFloatSliceExt::convert_to_f32_slice(c, &mut buf[..c.len()]);
                    acc.block(&buf[..c.len()], scale);
                }
            }
            candle_core::CpuStorage::BF16(v) => {
                let mut buf = [0f32; BLOCK];
                for c in v[start..end].chunks(BLOCK) {
                    half::slice::HalfFloatSliceExt::convert_to_f32_slice(c, &mut buf[..c.len()]);
                    acc.block(&buf[..c.len()], scale);
                }
            }
            _ => {
                drop(storage);
                return on_device(&t, scale, binades);
            }
        },
        _ => {
            drop(storage);
            return on_device(&t, scale, binades);
        }
    }
    drop(storage);
    Ok(acc.finish(dtype, scale))
}

/// The same fields with candle ops on the tensor's own device (devices other than the CPU,
/// and types the CPU pass does not read, such as f64, which is taken through f32), read in
/// one host transfer.
pub(crate) fn on_device(t: &Tensor, scale: f64, binades: bool) -> Result<(TensorStats, Option<Vec<u64>>)> {
    match device_vector(t, scale, binades)? {
        Measured::Known(s, h) => Ok((s, h)),
        Measured::Pending(v) => {
            let values = read_vector(&v)?;
            Ok(from_vector(&values, t.dtype(), t.elem_count() as u64, scale, binades))
        }
    }
}

/// Statistics computed on the host, or on the device and not read yet.
#[derive(Debug)]
pub(crate) enum Measured {
    /// Known (an empty tensor needs no device work).
    Known(TensorStats, Option<Vec<u64>>),
    /// [`VECTOR_LEN`] values (with the histogram's [`BINADES`] after them when asked for)
    /// in the device's widest float type, for [`from_vector`].
    Pending(Tensor),
}

/// Scalars of a statistics vector before the histogram: nan, inf, zeros, sum, amax, amin,
/// under16, underbf, over16.
pub(crate) const VECTOR_LEN: usize = 9;

/// The widest float type of a device (Metal has no f64).
fn acc_dtype(dev: &Device) -> DType {
    if matches!(dev, Device::Metal(_)) {
        DType::F32
    } else {
        DType::F64
    }
}

/// Reads a statistics vector (or several concatenated) in one host transfer.
pub(crate) fn read_vector(v: &Tensor) -> Result<Vec<f64>> {
    Ok(match v.dtype() {
        DType::F64 => v.to_vec1::<f64>()?,
        _ => v
            .to_dtype(DType::F32)?
            .to_vec1::<f32>()?
            .into_iter()
            .map(f64::from)
            .collect(),
    })
}

/// The statistics of `t` as one vector on its device, nothing read: every field with
/// tensor ops, the binade histogram too (each magnitude's binade from `log2`, corrected
/// against exact powers of two, counted with `index_add`).
pub(crate) fn device_vector(t: &Tensor, scale: f64, binades: bool) -> Result<Measured> {
    let dtype = t.dtype();
    let n = t.elem_count();
    if n == 0 {
        let acc = Acc::new(binades);
        let (s, h) = acc.finish(dtype, scale);
        return Ok(Measured::Known(s, h));
    }
    let dev = t.device();
    let acc_dt = acc_dtype(dev);
    let a = t.flatten_all()?.to_dtype(DType::F32)?.abs()?;
    let count = |m: &Tensor| -> Result<Tensor> { Ok(m.to_dtype(acc_dt)?.sum_all()?) };
    let nan = count(&a.ne(&a)?)?;
    let inf = count(&a.eq(f32::INFINITY)?)?;
    let finite = a.le(f32::MAX)?;
    let zero = a.eq(0f32)?;
    let zeros = count(&zero)?;
    let zeros_t = a.zeros_like()?;
    let fin_a = finite.where_cond(&a, &zeros_t)?;
    let sum = fin_a.to_dtype(acc_dt)?.sum_all()?;
    let amax = fin_a.max_all()?.to_dtype(acc_dt)?;
    let nz = finite.mul(&zero.eq(0u8)?)?;
    let inf_t = (a.ones_like()? * f64::INFINITY)?;
    let amin = nz.where_cond(&a, &inf_t)?.min_all()?.to_dtype(acc_dt)?;
    let d = a.to_dtype(acc_dt)?;
    let below = |thr: f64| -> Result<Tensor> { count(&d.lt(thr)?.mul(&nz)?) };
    let under16 = below(F16_MIN_NORMAL / scale)?;
    let underbf = below(BF16_MIN_NORMAL / scale)?;
    let over16 = count(&d.gt(F16_MAX / scale)?.mul(&finite)?)?;
    let scalars = Tensor::stack(&[nan, inf, zeros, sum, amax, amin, under16, underbf, over16], 0)?;
    let v = if binades {
        Tensor::cat(&[scalars, histogram(&a, &nz, acc_dt)?], 0)?
    } else {
        scalars
    };
    Ok(Measured::Pending(v))
}

/// The binade histogram of the magnitudes `a` (f32) where `nz` (nonzero finite) holds, on
/// their device: [`BINADES`] counts in `acc_dt`.
fn histogram(a: &Tensor, nz: &Tensor, acc_dt: DType) -> Result<Tensor> {
    let dev = a.device();
    // pow[b] = 2^(b-127), the lower edge of biased exponent b (0 for the subnormals' bin;
    // pow[255] = 2^128 is inf in f32, above every finite value).
    let pow: Vec<f32> = (0..=BINADES as i32)
        .map(|b| if b == 0 { 0.0 } else { 2f32.powi(b - 127) })
        .collect();
    let pow = Tensor::new(pow.as_slice(), dev)?;
    let last = (BINADES - 1) as f64;
    // floor(log2 a) + 127 may be one off at the edges: compare with the exact powers.
    let est = (a.log()? * std::f64::consts::LOG2_E)?
        .floor()?
        .affine(1.0, 127.0)?
        .clamp(0.0, last)?;
    let est = nz.where_cond(&est, &a.zeros_like()?)?;
    let lo = pow.index_select(&est.to_dtype(DType::U32)?, 0)?;
    let hi = pow.index_select(&est.affine(1.0, 1.0)?.to_dtype(DType::U32)?, 0)?;
    let b = ((est + a.ge(&hi)?.to_dtype(DType::F32)?)? - a.lt(&lo)?.to_dtype(DType::F32)?)?.clamp(0.0, last)?;
    // Zeros and non-finite values go to a bin past the end, dropped.
    let spill = (a.ones_like()? * BINADES as f64)?;
    let b = nz.where_cond(&b, &spill)?.to_dtype(DType::U32)?;
    let ones = Tensor::ones(a.elem_count(), acc_dt, dev)?;
    let counts = Tensor::zeros(BINADES + 1, acc_dt, dev)?.index_add(&b, &ones, 0)?;
    Ok(counts.narrow(0, 0, BINADES)?)
}

/// The statistics from a vector [`device_vector`] made, read on the host.
pub(crate) fn from_vector(
    v: &[f64],
    dtype: DType,
    n: u64,
    scale: f64,
    binades: bool,
) -> (TensorStats, Option<Vec<u64>>) {
    let c = |i: usize| v.get(i).copied().unwrap_or(0.0);
    let hist = binades.then(|| {
        (0..BINADES)
            .map(|i| c(VECTOR_LEN + i).max(0.0) as u64)
            .collect::<Vec<u64>>()
    });
    let acc = Acc {
        n,
        nan: c(0) as u64,
        inf: c(1) as u64,
        zeros: c(2) as u64,
        sum: c(3),
        amax: c(4) as f32,
        amin: c(5) as f32,
        under16: c(6) as u64,
        underbf: c(7) as u64,
        over16: c(8) as u64,
        binades: hist,
    };
    acc.finish(dtype, scale)
}

/// Fraction of the histogram's values (of `elements`) that times `scale` (a power of two)
/// fall below `2^min_exp` (f16's smallest normal: -14).
pub(crate) fn fraction_below(hist: &[u64], elements: u64, scale: f64, min_exp: i32) -> f64 {
    let e = scale.log2().round() as i32;
    // Value binade b (biased) is [2^(b-127), 2^(b-126)); times 2^e it is below 2^min_exp
    // when b - 127 + e < min_exp.
    let below: u64 = hist
        .iter()
        .enumerate()
        .filter(|(b, _)| (*b as i32).max(1) - 127 + e < min_exp)
        .map(|(_, c)| *c)
        .sum();
    below as f64 / elements.max(1) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_device_path_matches_the_cpu_pass() {
        let v: Vec<f32> = (0..1000)
            .map(|i| match i % 7 {
                0 => 0.0,
                1 => 1e-9 * i as f32,
                2 => 7e4,
                3 => -(i as f32),
                4 => 3e-6,
                _ => (i as f32).sin(),
            })
            .collect();
        let t = Tensor::new(v.as_slice(), &Device::Cpu).unwrap();
        for scale in [1.0f32, 1024.0] {
            let (a, ha) = compute(&t, scale, true).unwrap();
            let (b, hb) = on_device(&t, scale as f64, true).unwrap();
            assert_eq!(ha, hb);
            assert_eq!(
                (a.elements, a.nonfinite, a.amax, a.amin_nonzero, a.zero_frac),
                (b.elements, b.nonfinite, b.amax, b.amin_nonzero, b.zero_frac)
            );
            assert_eq!(
                (a.underflow_f16, a.underflow_bf16, a.overflow_f16),
                (b.underflow_f16, b.underflow_bf16, b.overflow_f16)
            );
            assert!((a.mean_abs - b.mean_abs).abs() <= 1e-5 * a.mean_abs);
        }
    }

    #[test]
    fn the_histogram_gives_the_underflow_at_any_power_of_two_scale() {
        let v: Vec<f32> = (0..2000).map(|i| 1e-12 * 1.02f32.powi(i)).collect();
        let t = Tensor::new(v.as_slice(), &Device::Cpu).unwrap();
        let (_, h) = compute(&t, 1.0, true).unwrap();
        let h = h.unwrap();
        for e in [0, 4, 10, 16, 24] {
            let s = 2f32.powi(e);
            let direct = TensorStats::of(&t, s).unwrap().underflow_f16;
            assert_eq!(fraction_below(&h, 2000, s as f64, -14), direct, "scale 2^{e}");
        }
    }
}
