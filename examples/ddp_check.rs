//! The data-parallel scenarios of `tests/dist.rs` across real processes: run it under
//! `mpirun -np 2` and `-np 3` (CI does both). Every rank trains its shard; ranks compare
//! their final weights bit for bit, and rank 0 compares them with one process training whole
//! batches (where the world size divides the batch). ZeRO and overlapped runs must equal the
//! plain run bit for bit on any world size, and ranks that disagree (lengths, buckets,
//! options, a parameter only one rank has, `no_sync` on one rank: `disagree.rs`) must all
//! fail with a `Mismatch` before any data moves. Exits non-zero on the first failure, on
//! every rank. Last, rank 1 stops answering for 3 s and rank 0, waiting 1 s, must fail with
//! a timeout instead of hanging.
//!
//! ```sh
//! cargo build --release --features mpi --example ddp_check
//! mpirun -np 2 target/release/examples/ddp_check
//! mpirun -np 3 target/release/examples/ddp_check
//! ```

#[path = "../tests/dist_scenarios/mod.rs"]
mod dist_scenarios;

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Result, bail};
use candle_amp::distributed::{Communicator, MpiComm, Sharding};
use candle_amp::{HalfType, OptLevel};
use dist_scenarios::*;

fn state_bytes(r: &Run) -> Vec<u8> {
    let mut out = Vec::new();
    for (name, bits) in &r.state {
        out.extend(name.as_bytes());
        out.push(0);
        for b in bits {
            out.extend(b.to_le_bytes());
        }
    }
    out
}

fn main() -> Result<()> {
    if !MpiComm::launched() {
        eprintln!(
            "run me under MPI: mpirun -np 2 {}",
            std::env::args().next().unwrap_or_default()
        );
        std::process::exit(2);
    }
    let mpi = Arc::new(MpiComm::with_timeout(Duration::from_secs(120))?);
    let comm: Arc<dyn Communicator> = mpi.clone();
    let (rank, world) = (comm.rank(), comm.world_size());
    if world < 2 {
        bail!("run me on 2 or more ranks");
    }
    // The comparisons with one process need equal shards of each batch; the others hold on
    // any world size (a shard then drops the batch's last rows, the same in both runs).
    let whole = B.is_multiple_of(world);
    let scenarios = [
        ("guard O0", OptLevel::O0, HalfType::F16, Api::Guard, false, false, 1e-5),
        (
            "guard O2 f16",
            OptLevel::O2,
            HalfType::F16,
            Api::Guard,
            false,
            false,
            4e-3,
        ),
        (
            "guard O2 bf16",
            OptLevel::O2,
            HalfType::Bf16,
            Api::Guard,
            false,
            false,
            3e-2,
        ),
        (
            "GradScaler, 2 micro-batches, O0",
            OptLevel::O0,
            HalfType::F16,
            Api::ScalerAccumulating,
            false,
            false,
            1e-5,
        ),
        (
            "GradScaler, 2 micro-batches, O1",
            OptLevel::O1,
            HalfType::F16,
            Api::ScalerAccumulating,
            false,
            false,
            4e-3,
        ),
        (
            "synchronised batch norm O0",
            OptLevel::O0,
            HalfType::F16,
            Api::Guard,
            true,
            false,
            1e-5,
        ),
        (
            "synchronised batch norm O2",
            OptLevel::O2,
            HalfType::F16,
            Api::Guard,
            true,
            false,
            4e-3,
        ),
        (
            "parameter unused on rank 1+",
            OptLevel::O0,
            HalfType::F16,
            Api::Guard,
            false,
            true,
            1e-5,
        ),
    ];
    let mut failures = 0;
    if !whole && rank == 0 {
        eprintln!("{world} ranks do not divide batches of {B}: the comparisons with one process are skipped");
    }
    for (name, level, half, api, bn, extra, tol) in scenarios.into_iter().filter(|_| whole) {
        let run = train(Some(comm.clone()), world, level, half, api, bn, extra);
        let mut problems = Vec::new();
        // Bit-identical across ranks: everyone compares with rank 0's bytes.
        let mine = state_bytes(&run);
        let mut root = mine.clone();
        comm.broadcast_bytes(&mut root, 0)?;
        if root != mine {
            problems.push(format!("rank {rank}'s weights differ from rank 0's"));
        }
        let skips = if bn { 0 } else { 1 };
        if run.skipped != skips {
            problems.push(format!("{} skipped steps, expected {skips}", run.skipped));
        }
        // One reduction per optimizer step; one collective per 256-byte bucket of it.
        if run.reductions != STEPS as u64 {
            problems.push(format!("{} gradient reductions for {STEPS} steps", run.reductions));
        }
        if rank == 0 {
            let one = train(None, world, level, half, api, bn, extra);
            for ((n, a), (_, b)) in run.state.iter().zip(&one.state) {
                for (i, (x, y)) in a.iter().zip(b).enumerate() {
                    let (x, y) = (f32::from_bits(*x), f32::from_bits(*y));
                    if (x - y).abs() > tol * y.abs().max(1.0) {
                        problems.push(format!("{n}[{i}] is {x} on {world} ranks and {y} in one process"));
                        break;
                    }
                }
            }
        }
        // Every rank learns whether any failed, so all exit alike.
        let mut bad = [problems.len() as f32];
        comm.all_reduce_sum(&mut bad)?;
        for p in &problems {
            eprintln!("rank {rank}: {name}: {p}");
        }
        if bad[0] > 0.0 {
            failures += 1;
        } else if rank == 0 {
            eprintln!(
                "{name}: {world} ranks equal one process; weights bit-identical across ranks; {} reductions, {} collectives",
                run.reductions, run.collectives
            );
        }
    }
    failures += collectives(&*comm, rank, world)?;
    failures += sharded(&comm, rank, world)?;
    failures += overlapped(&comm, rank, world)?;
    failures += disagreements(&comm, rank)?;
    // A rank that stops answering: the others fail with a timeout instead of hanging. Rank
    // 1+ arrive 3 s late at a barrier rank 0 waits for 1 s; then everyone meets again.
    mpi.set_timeout(Duration::from_secs(1));
    let late = if rank == 0 {
        comm.barrier()
    } else {
        std::thread::sleep(Duration::from_secs(3));
        Ok(())
    };
    mpi.set_timeout(Duration::from_secs(120));
    if rank == 0 {
        match late {
            Err(candle_amp::AmpError::Distributed {
                kind: candle_amp::DistErrorKind::Timeout,
                detail,
                ..
            }) => eprintln!("a rank that stops answering: rank 0 timed out ({detail})"),
            other => {
                eprintln!("a rank that stops answering: rank 0 got {other:?}, not a timeout");
                failures += 1;
            }
        }
    } else {
        // Joins the barrier rank 0 gave up on (MPI completes it in the background).
        comm.barrier()?;
    }
    comm.barrier()?;
    if failures > 0 {
        eprintln!("rank {rank}: {failures} scenario(s) failed");
        std::process::exit(1);
    }
    if rank == 0 {
        println!("ddp_check: every scenario passed on {world} ranks");
    }
    Ok(())
}

/// Ranks that disagree (`tests/dist_scenarios/disagree.rs`): every case must fail on every
/// rank with a `Mismatch` before any data moves. Returns the number of failed cases.
fn disagreements(comm: &Arc<dyn Communicator>, rank: usize) -> Result<usize> {
    let mut failures = 0;
    for (name, outcome) in dist_scenarios::disagree::run_all(comm) {
        let mut bad = [if outcome.is_err() { 1.0f32 } else { 0.0 }];
        comm.all_reduce_sum(&mut bad)?;
        match &outcome {
            Err(p) => eprintln!("rank {rank}: disagreement \"{name}\": {p}"),
            Ok(detail) if rank == 0 && bad[0] == 0.0 => {
                eprintln!("disagreement \"{name}\": as expected on every rank ({detail})")
            }
            Ok(_) => {}
        }
        if bad[0] > 0.0 {
            failures += 1;
        }
    }
    Ok(failures)
}

/// ZeRO stages 1 and 2 across real processes: each sharded run ends with the unsharded
/// run's working weights bit for bit on every rank, and each parameter's f32 master on its
/// owner equal to the unsharded run's. Returns the number of failed scenarios.
fn sharded(comm: &Arc<dyn Communicator>, rank: usize, world: usize) -> Result<usize> {
    let adamw_clipped = Extras::adamw_clipped();
    let cases = [
        (
            "O2 f16, AdamW, clipped",
            OptLevel::O2,
            HalfType::F16,
            Api::Guard,
            adamw_clipped,
        ),
        (
            "O3 bf16, SGD",
            OptLevel::O3,
            HalfType::Bf16,
            Api::Guard,
            Extras::default(),
        ),
        (
            "O1 f16, GradScaler, 2 micro-batches, AdamW, clipped",
            OptLevel::O1,
            HalfType::F16,
            Api::ScalerAccumulating,
            adamw_clipped,
        ),
    ];
    let mut failures = 0;
    for (name, level, half, api, extras) in cases {
        let plain = train_with(Some(comm.clone()), world, level, half, api, false, false, extras);
        for stage in [Sharding::Stage1, Sharding::Stage2] {
            let run = train_with(
                Some(comm.clone()),
                world,
                level,
                half,
                api,
                false,
                false,
                Extras {
                    sharding: stage,
                    ..extras
                },
            );
            let mut problems = Vec::new();
            if run.working != plain.working {
                problems.push("working weights differ from the unsharded run's".to_string());
            }
            for (n, bits) in &run.state {
                let want = &plain.state.iter().find(|(m, _)| m == n).expect("same names").1;
                if run.owned.contains(n) && bits != want {
                    problems.push(format!(
                        "`{n}`'s f32 value on its owner differs from the unsharded run's"
                    ));
                }
            }
            if run.skipped != plain.skipped || run.norms != plain.norms {
                problems.push("skipped steps or clipping norms differ from the unsharded run's".into());
            }
            let mut bad = [problems.len() as f32];
            comm.all_reduce_sum(&mut bad)?;
            for p in &problems {
                eprintln!("rank {rank}: {stage} {name}: {p}");
            }
            if bad[0] > 0.0 {
                failures += 1;
            } else if rank == 0 {
                eprintln!(
                    "{stage} {name}: {world} ranks step bit for bit like the unsharded run; rank 0 owns {} of {} tensors",
                    run.owned.len(),
                    run.state.len()
                );
            }
        }
    }
    Ok(failures)
}

/// Communication overlapped with the backward across real processes: each overlapped run
/// ends with the state of the same run without overlap, bit for bit on every rank, every
/// step after the first reduced from the buckets sent during the backward. Returns the
/// number of failed scenarios.
fn overlapped(comm: &Arc<dyn Communicator>, rank: usize, world: usize) -> Result<usize> {
    let ac = Extras::adamw_clipped();
    let cases = [
        (
            "O2 f16, AdamW, clipped",
            OptLevel::O2,
            HalfType::F16,
            Api::Guard,
            false,
            ac,
        ),
        (
            "O1 bf16, 2 micro-batches under no_sync, AdamW, clipped",
            OptLevel::O1,
            HalfType::Bf16,
            Api::GuardAccumulating,
            false,
            Extras { no_sync: true, ..ac },
        ),
        (
            "O3 f16, synchronised batch norm",
            OptLevel::O3,
            HalfType::F16,
            Api::Guard,
            true,
            Extras::default(),
        ),
        (
            "O2 bf16, ZeRO-1",
            OptLevel::O2,
            HalfType::Bf16,
            Api::Guard,
            false,
            Extras {
                sharding: Sharding::Stage1,
                ..Extras::default()
            },
        ),
    ];
    // And a head only rank 0 uses: the other ranks overlap too (their own graph decides
    // which of rank 0's buckets they can send early).
    let cases = cases.into_iter().map(|c| (c, false)).chain([(
        (
            "O2 f16, a head only rank 0 uses",
            OptLevel::O2,
            HalfType::F16,
            Api::Guard,
            false,
            Extras::default(),
        ),
        true,
    )]);
    let mut failures = 0;
    for ((name, level, half, api, bn, extras), extra) in cases {
        let plain = train_with(Some(comm.clone()), world, level, half, api, bn, extra, extras);
        let over = train_with(
            Some(comm.clone()),
            world,
            level,
            half,
            api,
            bn,
            extra,
            Extras {
                overlap: true,
                ..extras
            },
        );
        let mut problems = Vec::new();
        if over.state != plain.state || over.working != plain.working {
            problems.push("the weights differ from the run without overlap".to_string());
        }
        if over.skipped != plain.skipped || over.norms != plain.norms {
            problems.push("skipped steps or clipping norms differ".to_string());
        }
        // With synchronised batch norm the buckets wait for the end of the backward; else
        // every rank sends some during it.
        if over.overlapped_steps != STEPS as u64 - 1 || (over.early_buckets == 0) != bn {
            problems.push(format!(
                "{} of {STEPS} steps reduced from the buckets, {} bucket(s) sent during the backward",
                over.overlapped_steps, over.early_buckets
            ));
        }
        let mut bad = [problems.len() as f32];
        comm.all_reduce_sum(&mut bad)?;
        for p in &problems {
            eprintln!("rank {rank}: overlap {name}: {p}");
        }
        if bad[0] > 0.0 {
            failures += 1;
        } else if rank == 0 {
            eprintln!(
                "overlap {name}: {world} ranks step bit for bit like the run without overlap; {} bucket(s) left during the backward on rank 0",
                over.early_buckets
            );
        }
    }
    Ok(failures)
}

/// Reduce-scatter and all-gather across real processes: the all-reduce adds in rank order
/// (`LocalGroup`'s bits) and each rank's block of the reduce-scatter is the matching part of
/// it, bit for bit on any number of ranks and at every size (ZeRO stage 2 then steps like
/// the unsharded run); every rank gets every rank's bytes in rank order, and a partition
/// the ranks disagree on fails on every rank before any data moves. Returns 1 if any rank
/// saw a problem, else 0.
fn collectives(comm: &dyn Communicator, rank: usize, world: usize) -> Result<usize> {
    let mut problems = Vec::new();
    // Values of mixed magnitude: a sum in another order rounds differently from 3 ranks on.
    let contribution = |r: usize, i: usize| {
        let big = if (i + r).is_multiple_of(3) { 1.0e8 } else { 1.0 };
        (i as f32 * 0.37 + r as f32 * 1.91 - 2.5) * big
    };
    // Small and large blocks: MPI libraries switch algorithms (and orders) with the size.
    for block in [5, 3001, 70_001] {
        let send: Vec<f32> = (0..world * block).map(|i| contribution(rank, i)).collect();
        // `LocalGroup`'s order: 0, plus rank 0's, plus rank 1's, ...
        let want: Vec<u32> = (0..world * block)
            .map(|i| (0..world).fold(0.0f32, |s, r| s + contribution(r, i)).to_bits())
            .collect();
        let mut all = send.clone();
        comm.all_reduce_sum(&mut all)?;
        let mut mine = vec![f32::NAN; block];
        comm.reduce_scatter_sum(&send, &mut mine)?;
        let first_diff = |got: &[f32], want: &[u32]| got.iter().zip(want).position(|(a, b)| a.to_bits() != *b);
        if let Some(i) = first_diff(&all, &want) {
            problems.push(format!(
                "blocks of {block}: all_reduce_sum[{i}] is {}, the sum in rank order {}",
                all[i],
                f32::from_bits(want[i])
            ));
        }
        if let Some(i) = first_diff(&mine, &want[rank * block..(rank + 1) * block]) {
            problems.push(format!(
                "blocks of {block}: reduce_scatter_sum[{i}] is {}, the sum in rank order {}",
                mine[i],
                f32::from_bits(want[rank * block + i])
            ));
        }
    }
    let bytes = |r: usize| (0..7).map(move |i| (r * 31 + i * 7) as u8);
    let mut gathered = vec![0u8; world * 7];
    comm.all_gather_bytes(&bytes(rank).collect::<Vec<_>>(), &mut gathered)?;
    if gathered != (0..world).flat_map(bytes).collect::<Vec<_>>() {
        problems.push(format!("all_gather_bytes gave {gathered:?}"));
    }
    let b = if rank == 0 { 2 } else { 3 };
    let mut untouched = vec![-7.0f32; b];
    match comm.reduce_scatter_sum(&vec![1.0; world * b], &mut untouched) {
        Err(candle_amp::AmpError::Distributed {
            kind: candle_amp::DistErrorKind::Mismatch,
            ..
        }) if untouched.iter().all(|v| *v == -7.0) => {}
        other => problems.push(format!("a partition the ranks disagree on gave {other:?}")),
    }
    let mut bad = [problems.len() as f32];
    comm.all_reduce_sum(&mut bad)?;
    for p in &problems {
        eprintln!("rank {rank}: collectives: {p}");
    }
    if bad[0] > 0.0 {
        return Ok(1);
    }
    if rank == 0 {
        eprintln!(
            "collectives: all-reduce in rank order and reduce-scatter its blocks bit for bit (blocks of 5 to 70001), all-gather in rank order, a disagreeing partition refused on every rank"
        );
    }
    Ok(0)
}
