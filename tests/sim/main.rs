//! `innerwall-sim` (`cargo xtask simulate`): runs the policy stream's simulator over many seeds
//! and prints seeds per second and every failing seed with the command that replays it.

use std::time::Instant;

use clap::Parser;
use innerwall_e2e::sim::{self, Params};

#[derive(Parser)]
#[command(about = "Deterministic simulation of the policy stream (issue 30)")]
struct Args {
    /// How many seeds to run (from --seed on).
    #[arg(long, default_value_t = 100)]
    seeds: u64,
    /// Steps of faults per seed before they stop and convergence is required.
    #[arg(long, default_value_t = 300)]
    steps: u32,
    /// The first seed; with --seeds 1, replays it and prints its trace on failure.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Agents per run.
    #[arg(long, default_value_t = 3)]
    agents: usize,
    /// Replicas per run.
    #[arg(long, default_value_t = 2)]
    replicas: usize,
    /// Print each run's trace, failed or not.
    #[arg(long)]
    trace: bool,
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    let started = Instant::now();
    let mut failed = 0;
    for seed in args.seed..args.seed + args.seeds {
        let params = Params { seed, steps: args.steps, agents: args.agents, replicas: args.replicas };
        let result = sim::run(&params);
        if let (true, Ok(trace)) = (args.trace, &result) {
            for line in trace {
                println!("{line}");
            }
        }
        if let Err(failure) = result {
            failed += 1;
            if args.seeds == 1 || args.trace {
                for line in &failure.trace {
                    println!("{line}");
                }
            }
            println!("FAILED {failure}");
            println!(
                "  replay: cargo xtask simulate --seeds 1 --seed {seed} --steps {} --agents {} --replicas {}",
                args.steps, args.agents, args.replicas
            );
        }
    }
    let secs = started.elapsed().as_secs_f64();
    println!(
        "simulate: {} seeds of {} steps ({} agents, {} replicas) in {secs:.1} s: {:.0} seeds/s, {failed} failed",
        args.seeds,
        args.steps,
        args.agents,
        args.replicas,
        args.seeds as f64 / secs.max(1e-9)
    );
    println!(
        "FIGURE {{\"id\":\"SIM\",\"name\":\"simulated fault schedules per second, one core\",\"value\":{:.1},\"unit\":\"seeds/s\",\"goal\":{{\"op\":\">\",\"bound\":1.65}}}}",
        args.seeds as f64 / secs.max(1e-9)
    );
    if failed > 0 { std::process::ExitCode::FAILURE } else { std::process::ExitCode::SUCCESS }
}
