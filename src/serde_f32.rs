//! serde for `f32` values that may be infinite or NaN. JSON has no such numbers (serde_json
//! writes them as `null` and cannot read that back), yet `max_loss_scale = inf` is PyTorch's
//! setting and a scale can collapse to 0 and unscale by infinity. Finite values are written
//! as numbers (exactly: serde_json writes the shortest round-tripping form); non-finite ones
//! as the strings `"inf"`, `"-inf"` and `"NaN"`.

use std::fmt;

use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::ser::{SerializeSeq, Serializer};

fn text(v: f32) -> &'static str {
    if v.is_nan() {
        "NaN"
    } else if v > 0.0 {
        "inf"
    } else {
        "-inf"
    }
}

/// Serialises one value.
pub(crate) fn serialize<S: Serializer>(v: &f32, s: S) -> Result<S::Ok, S::Error> {
    if v.is_finite() {
        s.serialize_f32(*v)
    } else {
        s.serialize_str(text(*v))
    }
}

struct F32Visitor;

impl<'de> Visitor<'de> for F32Visitor {
    type Value = f32;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a number or one of \"inf\", \"-inf\", \"NaN\"")
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<f32, E> {
        Ok(v as f32)
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<f32, E> {
        Ok(v as f32)
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<f32, E> {
        Ok(v as f32)
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<f32, E> {
        match v {
            "inf" => Ok(f32::INFINITY),
            "-inf" => Ok(f32::NEG_INFINITY),
            "NaN" => Ok(f32::NAN),
            _ => Err(E::invalid_value(de::Unexpected::Str(v), &self)),
        }
    }
}

/// Deserialises one value.
pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f32, D::Error> {
    d.deserialize_any(F32Visitor)
}

/// The same for `Vec<f32>`.
pub(crate) mod vec {
    use super::*;

    struct Elem(f32);

    impl serde::Serialize for Elem {
        fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            super::serialize(&self.0, s)
        }
    }

    impl<'de> serde::Deserialize<'de> for Elem {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            super::deserialize(d).map(Elem)
        }
    }

    /// Serialises a vector.
    pub(crate) fn serialize<S: Serializer>(v: &[f32], s: S) -> Result<S::Ok, S::Error> {
        let mut seq = s.serialize_seq(Some(v.len()))?;
        for x in v {
            seq.serialize_element(&Elem(*x))?;
        }
        seq.end()
    }

    struct VecVisitor;

    impl<'de> Visitor<'de> for VecVisitor {
        type Value = Vec<f32>;

        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a list of numbers")
        }

        fn visit_seq<A: SeqAccess<'de>>(self, mut a: A) -> Result<Vec<f32>, A::Error> {
            let mut out = Vec::with_capacity(a.size_hint().unwrap_or(0).min(1 << 20));
            while let Some(Elem(x)) = a.next_element()? {
                out.push(x);
            }
            Ok(out)
        }
    }

    /// Deserialises a vector.
    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<f32>, D::Error> {
        d.deserialize_seq(VecVisitor)
    }
}
