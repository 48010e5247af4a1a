//! `innerwall retention`: the retention `serve` applies hourly, run now by an operator
//! (`retention::run_now`), with its steps on a terminal and a summary at the end. Its settings
//! are `serve`'s flags, so the configuration file's values hold for it too.

use clap::Args;
use innerwall_control_plane::retention;

use crate::ctx::Ctx;
use crate::duration;
use crate::serve::{RetentionArgs, days};

#[derive(Debug, Args)]
pub struct RetentionCmd {
    /// How long flow evidence is kept (whole days), as `serve --flow-retention`.
    #[arg(long, default_value = "30d", value_parser = duration::arg)]
    flow_retention: std::time::Duration,
    #[command(flatten)]
    retention: RetentionArgs,
}

pub async fn run(ctx: &Ctx, cmd: &RetentionCmd) -> anyhow::Result<()> {
    let flows = days(cmd.flow_retention, "--flow-retention")?;
    let kept = cmd.retention.retention(flows)?;
    let run = retention::run_now(
        &ctx.pool,
        &ctx.actor,
        flows.num_days(),
        &kept,
        chrono::Utc::now(),
        &crate::output::progress,
    )
    .await?;
    if ctx.json {
        println!("{}", serde_json::to_string(&run)?);
        return Ok(());
    }
    let r = run.removed;
    println!(
        "retention applied: {} flow partition(s) dropped; deleted {} row(s): {} retired workload(s), \
         {} policy version(s), {} policy content(s), {} label set(s), {} audit record(s), {} provisioning \
         and {} operator token(s)",
        run.flow_partitions.len(),
        r.total(),
        r.workloads,
        r.policy_history,
        r.policy_contents,
        r.label_history,
        r.audit,
        r.provisioning_tokens,
        r.operator_tokens
    );
    Ok(())
}
