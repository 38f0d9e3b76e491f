//! `LocalGroup`'s unit tests: they read the group's private state.

use super::*;
use candle_core::{DType, Device, Tensor};

/// The device the tests run on: `CANDLE_AMP_TEST_DEVICE=cuda` (with the `cuda` feature)
/// or the CPU.
fn test_device() -> Device {
    match std::env::var("CANDLE_AMP_TEST_DEVICE").as_deref() {
        #[cfg(feature = "cuda")]
        Ok("cuda") => Device::new_cuda(0).expect("CANDLE_AMP_TEST_DEVICE=cuda needs a CUDA device"),
        _ => Device::Cpu,
    }
}

#[test]
fn the_default_tensor_all_reduce_sums_on_the_tensors_device_and_refuses_other_types() {
    let dev = test_device();
    let comms = LocalGroup::with_timeout(2, Duration::from_secs(60));
    let results: Vec<(Tensor, Tensor, Vec<AmpError>, Tensor)> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .iter()
            .map(|c| {
                let dev = dev.clone();
                s.spawn(move || {
                    let r = c.rank() as f32;
                    let t = Tensor::new(&[r + 1.0, 10.0 * (r + 1.0), -0.5, 0.25 * r], &dev).unwrap();
                    let sum = c.all_reduce_sum_tensor(&t).unwrap();
                    let empty = c
                        .all_reduce_sum_tensor(&Tensor::zeros(0, DType::F32, &dev).unwrap())
                        .unwrap();
                    // Refused on rank 0 only: had either call entered the collective, the
                    // ranks' next collectives would pair wrongly and fail.
                    let refused = if c.rank() == 0 {
                        vec![
                            c.all_reduce_sum_tensor(&t.to_dtype(DType::F16).unwrap()).unwrap_err(),
                            c.all_reduce_sum_tensor(&t.reshape((2, 2)).unwrap()).unwrap_err(),
                        ]
                    } else {
                        Vec::new()
                    };
                    let after = c.all_reduce_sum_tensor(&t.affine(1.0, 1.0).unwrap()).unwrap();
                    (sum, empty, refused, after)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (rank, (sum, empty, refused, after)) in results.iter().enumerate() {
        for t in [sum, empty, after] {
            assert!(t.device().same_device(&dev), "rank {rank}: {:?}", t.device());
            assert_eq!(t.dtype(), DType::F32);
        }
        assert_eq!(sum.to_vec1::<f32>().unwrap(), [3.0, 30.0, -1.0, 0.25], "rank {rank}");
        assert_eq!(after.to_vec1::<f32>().unwrap(), [5.0, 32.0, 1.0, 2.25], "rank {rank}");
        assert_eq!(empty.dims(), [0]);
        for e in refused {
            assert!(
                matches!(e, AmpError::InvalidArgument { argument: "t", .. }),
                "rank {rank}: {e}"
            );
        }
    }
    let msgs: Vec<String> = results[0].2.iter().map(|e| e.to_string()).collect();
    assert!(msgs[0].contains("F16") && msgs[0].contains("to_dtype"), "{}", msgs[0]);
    assert!(
        msgs[1].contains("[2, 2]") && msgs[1].contains("flatten_all"),
        "{}",
        msgs[1]
    );
}

#[test]
fn the_group_keeps_no_payload_after_a_collective_returned_on_every_rank() {
    let comms = LocalGroup::with_timeout(3, Duration::from_secs(60));
    std::thread::scope(|s| {
        for c in &comms {
            s.spawn(move || {
                let mut v = vec![c.rank() as f32; 1 << 16];
                c.all_reduce_sum(&mut v).unwrap();
                let mut b = vec![7u8; 1 << 16];
                c.broadcast_bytes(&mut b, 2).unwrap();
                let mut g = vec![0u8; 3 << 12];
                c.all_gather_bytes(&vec![c.rank() as u8; 1 << 12], &mut g).unwrap();
            });
        }
    });
    // Every rank returned from every call: nothing of theirs is left in the group.
    let st = comms[0].shared.state.lock().unwrap();
    assert!(st.last.is_none(), "the last collective's payloads are still held");
    assert!(st.slots.iter().all(Option::is_none));
    assert_eq!(st.arrived, 0);
}

#[test]
fn a_rank_that_panics_ends_its_peers_collectives_at_once() {
    // Rank 2 completes one collective and panics before the second: ranks 0 and 1, which
    // are already waiting in it (and would call more), fail at once with `PeerFailed`
    // instead of waiting out the 30 s timeout. A completed collective is unaffected.
    let comms = LocalGroup::with_timeout(3, Duration::from_secs(30));
    let start = Instant::now();
    let outcomes: Vec<std::thread::Result<Vec<Result<()>>>> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|c| {
                s.spawn(move || {
                    let mut v = vec![1.0f32; 4];
                    let first = c.all_reduce_sum(&mut v);
                    assert_eq!(v, [3.0; 4]);
                    if c.rank() == 2 {
                        std::thread::sleep(Duration::from_millis(100));
                        panic!("rank 2 fails between two collectives (an expected panic)");
                    }
                    vec![first, c.all_reduce_sum(&mut v), c.barrier()]
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join()).collect()
    });
    let elapsed = start.elapsed();
    assert!(elapsed < Duration::from_secs(10), "the peers waited {elapsed:?}");
    assert!(outcomes[2].is_err(), "rank 2 panicked");
    for (rank, out) in outcomes[..2].iter().enumerate() {
        let out = out.as_ref().expect("ranks 0 and 1 return");
        assert!(out[0].is_ok(), "rank {rank}: {:?}", out[0]);
        for e in &out[1..] {
            match e {
                Err(AmpError::Distributed {
                    kind: DistErrorKind::PeerFailed,
                    detail,
                    ..
                }) => assert!(detail.contains("rank 2 panicked"), "rank {rank}: {detail}"),
                other => panic!("rank {rank}: {other:?}"),
            }
        }
    }
}

/// Spins until `at` (sleeping is too coarse for the windows this test aims at).
fn spin_until(at: Instant) {
    while Instant::now() < at {
        std::hint::spin_loop();
    }
}

#[test]
fn a_rank_that_timed_out_is_never_part_of_a_completed_collective() {
    // Rank 1 arrives around rank 0's deadline: rank 0 either sees it (both complete) or
    // times out, and then rank 1 must fail too instead of completing with rank 0's
    // contribution.
    let timeout = Duration::from_micros(300);
    let (mut completed, mut failed) = (0, 0);
    for i in 0..3000u64 {
        let comms = LocalGroup::with_timeout(2, timeout);
        let start = Instant::now();
        let delay = Duration::from_micros((i * 7919) % 600);
        let results: Vec<Result<Vec<f32>>> = std::thread::scope(|s| {
            let handles: Vec<_> = comms
                .iter()
                .map(|c| {
                    s.spawn(move || {
                        if c.rank() == 1 {
                            spin_until(start + delay);
                        }
                        let mut v = vec![c.rank() as f32 + 1.0; 4];
                        c.all_reduce_sum(&mut v).map(|()| v)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        match (&results[0], &results[1]) {
            (Ok(a), Ok(b)) => {
                assert_eq!((a, b), (&vec![3.0; 4], &vec![3.0; 4]), "iteration {i}");
                completed += 1;
            }
            (Err(_), Err(_)) => failed += 1,
            (a, b) => panic!("iteration {i} (delay {delay:?}): rank 0 {a:?}, rank 1 {b:?}"),
        }
        for (r, res) in results.iter().enumerate() {
            if let Err(e) = res {
                assert!(
                    matches!(
                        e,
                        AmpError::Distributed {
                            kind: DistErrorKind::Timeout,
                            ..
                        }
                    ),
                    "iteration {i} rank {r}: {e}"
                );
            }
        }
    }
    eprintln!("{completed} completed, {failed} timed out");
}
