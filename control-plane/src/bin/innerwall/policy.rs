//! `innerwall render`, `service`, `address-group`, `ruleset` and `policy`: authoring the policy
//! model and its tests, written once against a [`Backend`] (this host's database or a control
//! plane's API), so both print alike. Services and address groups are the same kind of thing to
//! the CLI — a named, versioned set of members given as flags — so one generic [`ObjectCmd`] and
//! [`catalog`] serve both, each described by a [`Catalog`] impl.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use clap::{Args, Subcommand};
use innerwall_control_plane::counts::CountBounds;
use innerwall_control_plane::error::Error;
use innerwall_control_plane::foresight::{self, policy_tests};
use innerwall_control_plane::operations;
use innerwall_control_plane::page::{Page, PageRequest};
use innerwall_control_plane::policy::authoring::Committed;
use innerwall_control_plane::policy::model::ServiceEntry;
use innerwall_control_plane::policy::spec::{
    self, AddressGroupSpec, MAX_RULESET_FILE, RulesetSpec, ServiceSpec,
};
use innerwall_control_plane::policy::store::{self, AddressGroupView, ServiceView};
use innerwall_control_plane::safety::staged::{PromoteStaged, StagedView};
use innerwall_wire::policy::Cidr;
use sqlx::{PgConnection, PgPool};

use crate::backend::Backend;
use crate::output::{print_changed, print_json, print_table, report};
use crate::requests::Catalog;

#[derive(Debug, Args)]
pub struct Expect {
    /// Required: the version `show` printed; the write is refused if the object moved on since.
    #[arg(long, value_name = "VERSION")]
    expect_version: Option<i64>,
}

impl Expect {
    /// The version the operator read. Every update and delete is conditional (POL-8): without
    /// `--expect-version` the command is refused here, before anything is read or written, and
    /// the version is never filled in from a fresh read behind the operator's back.
    fn required(&self, noun: &str, verb: &str, name: &str) -> anyhow::Result<i64> {
        self.expect_version.with_context(|| {
            format!(
                "{noun} {verb} {name:?} needs --expect-version VERSION, the version `{noun} show` printed (updates and deletes are conditional on it); nothing was written"
            )
        })
    }
}

/// The subcommands of a named, versioned object (`service`, `address-group`, `ruleset`): create
/// and update from the flags `A`, delete, list and show by name. The per-object help of
/// `create`, `update` and `show` is set where the object is mounted (`mut_subcommand` in
/// `main.rs`).
#[derive(Debug, Subcommand)]
pub enum ObjectCmd<A: Args> {
    Create(A),
    Update {
        #[command(flatten)]
        object: A,
        #[command(flatten)]
        expect: Expect,
    },
    Delete {
        name: String,
        #[command(flatten)]
        expect: Expect,
    },
    List,
    Show {
        name: String,
    },
}

#[derive(Debug, Args)]
pub struct ServiceArgs {
    name: String,
    /// `tcp:80,443,8000-8080`, `udp:53`, `tcp:all`, `icmp`, `icmpv6`; repeatable.
    #[arg(long = "entry", required = true)]
    entries: Vec<String>,
    #[arg(long, default_value = "")]
    description: String,
}

#[derive(Debug, Args)]
pub struct GroupArgs {
    name: String,
    /// A CIDR in canonical spelling (a host route is /32 or /128); repeatable.
    #[arg(long = "cidr", required = true)]
    cidrs: Vec<String>,
    #[arg(long, default_value = "")]
    description: String,
}

/// Implements [`Catalog`] for a flags struct from the library calls of its kind. The members
/// field has one name in the flags, the spec and the view (`entries`, `cidrs`), which is also
/// the table column and the API body's key.
macro_rules! catalog {
    ($args:ty { $members:ident: $parse:path } => $spec:ident, $view:ident, $noun:literal,
     $path:literal, [$create:ident, $update:ident, $delete:ident, $page:ident, $show:ident]) => {
        impl Catalog for $args {
            const NOUN: &'static str = $noun;
            const MEMBERS: &'static str = stringify!($members);
            const PATH: &'static str = $path;
            type Spec = $spec;
            type View = $view;

            fn spec(&self) -> anyhow::Result<$spec> {
                let members = self.$members.iter().map(|text| $parse(text).map_err(anyhow::Error::from));
                Ok($spec {
                    name: self.name.clone(),
                    description: self.description.clone(),
                    $members: members.collect::<anyhow::Result<_>>()?,
                })
            }
            fn body(&self, with_name: bool) -> serde_json::Value {
                let mut body = serde_json::json!({
                    "description": self.description,
                    stringify!($members): self.$members,
                });
                if with_name {
                    body["name"] = self.name.clone().into();
                }
                body
            }
            fn arg_name(&self) -> &str {
                &self.name
            }
            async fn create(pool: &PgPool, actor: &str, spec: &$spec, counts: &CountBounds)
            -> Result<Committed<()>, Error> {
                operations::$create(pool, actor, spec, counts).await
            }
            async fn update(pool: &PgPool, actor: &str, spec: &$spec, expected: i64) -> Result<Committed<i64>, Error> {
                operations::$update(pool, actor, spec, expected).await
            }
            async fn delete(pool: &PgPool, actor: &str, name: &str, expected: i64) -> Result<Committed<()>, Error> {
                operations::$delete(pool, actor, name, expected).await
            }
            async fn page(conn: &mut PgConnection, request: &PageRequest) -> Result<Page<$view>, Error> {
                store::$page(conn, request).await
            }
            async fn show(conn: &mut PgConnection, name: &str) -> Result<$view, Error> {
                store::$show(conn, name).await
            }
            fn row(view: $view) -> Vec<String> {
                vec![view.name, view.version.to_string(), view.$members.join(" "), view.description]
            }
        }
    };
}

catalog!(ServiceArgs { entries: ServiceEntry::parse } => ServiceSpec, ServiceView, "service",
    "/api/v1/services", [create_service, update_service, delete_service, service_page, service_view]);
catalog!(GroupArgs { cidrs: Cidr::parse } => AddressGroupSpec, AddressGroupView, "address group",
    "/api/v1/address-groups",
    [create_address_group, update_address_group, delete_address_group, address_group_page, address_group_view]);

pub async fn catalog<A: Catalog>(b: &impl Backend, json: bool, cmd: &ObjectCmd<A>) -> anyhow::Result<()> {
    let noun = A::NOUN;
    match cmd {
        ObjectCmd::Create(args) => {
            let done = b.create(args).await?;
            report(json, &format!("{noun} {} created (version 1)", args.arg_name()), &done);
        }
        ObjectCmd::Update { object, expect } => {
            let expected = expect.required(noun, "update", object.arg_name())?;
            let done = b.update(object, expected).await?;
            report(json, &format!("{noun} {} updated (version {})", object.arg_name(), done.result), &done);
        }
        ObjectCmd::Delete { name, expect } => {
            let expected = expect.required(noun, "delete", name)?;
            let done = b.delete::<A>(name, expected).await?;
            report(json, &format!("{noun} {name} deleted"), &done);
        }
        ObjectCmd::List => print_objects::<A>(json, b.list::<A>().await?)?,
        ObjectCmd::Show { name } => print_objects::<A>(json, vec![b.show::<A>(name).await?])?,
    }
    Ok(())
}

/// `list` (every object) and `show` (one, as a list of one) of a catalog kind, from either source.
fn print_objects<A: Catalog>(json: bool, all: Vec<A::View>) -> anyhow::Result<()> {
    if json {
        return print_json(&all);
    }
    let rows = all.into_iter().map(A::row).collect();
    print_table(&["name", "version", A::MEMBERS, "description"], rows);
    Ok(())
}

/// `innerwall render`: every workload rendered now, recorded in the audit log with the
/// versions it moved.
pub async fn render(b: &impl Backend, json: bool) -> anyhow::Result<()> {
    print_changed(json, &b.render().await?);
    Ok(())
}

/// The ruleset file `ruleset create` and `ruleset update` read.
#[derive(Debug, Args)]
pub struct RulesetFile {
    #[arg(short, long)]
    file: PathBuf,
}

fn read_ruleset_file(path: &Path) -> anyhow::Result<RulesetSpec> {
    let (origin, text) = crate::file::read_bounded(path, MAX_RULESET_FILE)?;
    Ok(spec::parse_ruleset_file(&origin, &text)?)
}

/// `innerwall ruleset …`: the named, versioned object, and staging (FLOW-10).
#[derive(Debug, Subcommand)]
pub enum RulesetCmd {
    #[command(flatten)]
    Object(ObjectCmd<RulesetFile>),
    /// Stage a ruleset file (a new version of a ruleset, or a new one): every workload it
    /// touches evaluates it beside the rules in force and records what it would decide, and
    /// nothing is enforced by it until `promote-staged`. Staging a name again replaces it.
    Stage(RulesetFile),
    /// Drop a staged ruleset: its staged sets leave every policy.
    Unstage { name: String },
    /// The staged rulesets, with the workloads promoting each would change (one, by name, in
    /// full).
    Staged { name: Option<String> },
    /// Make a staged ruleset the ruleset, if it changes the rules in force of exactly as many
    /// workloads as you expect and no flow allowed now was pending-blocked, with no evidence
    /// gap, since each acknowledged its staged set (or --override says why).
    PromoteStaged {
        name: String,
        /// How many workloads' rules in force it must change; any other number changes nothing.
        #[arg(long)]
        expect_count: usize,
        /// Less evidence than this since a workload acknowledged its staged set is never enough.
        #[arg(long, default_value = "24h", value_parser = crate::duration::arg)]
        min_evidence: std::time::Duration,
        /// Promote without a SAFE verdict, for this reason (kept on the record).
        #[arg(long = "override")]
        override_reason: Option<String>,
    },
}

pub async fn ruleset(b: &impl Backend, json: bool, cmd: &RulesetCmd) -> anyhow::Result<()> {
    let cmd = match cmd {
        RulesetCmd::Object(cmd) => cmd,
        RulesetCmd::Stage(RulesetFile { file }) => {
            let spec = read_ruleset_file(file)?;
            let done = b.stage_ruleset(&spec).await?;
            let what =
                format!("ruleset {} staged (stage {}): nothing is enforced by it", spec.name, done.result);
            report(json, &what, &done);
            return Ok(());
        }
        RulesetCmd::Unstage { name } => {
            let done = b.unstage_ruleset(name).await?;
            report(json, &format!("ruleset {name} unstaged"), &done);
            return Ok(());
        }
        RulesetCmd::Staged { name } => {
            return print_staged(json, name.as_deref(), b.staged_rulesets().await?);
        }
        RulesetCmd::PromoteStaged { name, expect_count, min_evidence, override_reason } => {
            let request = PromoteStaged {
                name: name.clone(),
                expect_count: *expect_count,
                min_evidence: *min_evidence,
                override_reason: override_reason.clone(),
            };
            let done = b.promote_staged(&request).await?;
            let p = &done.result;
            let outcome = p.verdict["outcome"].as_str().unwrap_or("?");
            let mut what = format!(
                "ruleset {name} promoted from stage {} (ruleset version {}): {} workload(s), verdict {outcome}",
                p.stage,
                p.version,
                p.workloads.len()
            );
            if let Some(reason) = &p.override_reason {
                what.push_str(&format!(", overridden: {reason}"));
            }
            report(json, &what, &done);
            return Ok(());
        }
    };
    match cmd {
        ObjectCmd::Create(RulesetFile { file }) => {
            let spec = read_ruleset_file(file)?;
            let done = b.create_ruleset(&spec).await?;
            report(json, &format!("ruleset {} created (version 1)", spec.name), &done);
        }
        ObjectCmd::Update { object: RulesetFile { file }, expect } => {
            let spec = read_ruleset_file(file)?;
            let expected = expect.required("ruleset", "update", &spec.name)?;
            let done = b.update_ruleset(&spec, expected).await?;
            report(json, &format!("ruleset {} updated (version {})", spec.name, done.result), &done);
        }
        ObjectCmd::Delete { name, expect } => {
            let expected = expect.required("ruleset", "delete", name)?;
            let done = b.delete_ruleset(name, expected).await?;
            report(json, &format!("ruleset {name} deleted"), &done);
        }
        ObjectCmd::List => print_rulesets(json, cmd, b.rulesets().await?)?,
        ObjectCmd::Show { name } => print_rulesets(json, cmd, vec![b.ruleset(name).await?])?,
    }
    Ok(())
}

/// `ruleset staged` (a table) and `ruleset staged NAME` (its workloads and the file).
fn print_staged(json: bool, name: Option<&str>, all: Vec<StagedView>) -> anyhow::Result<()> {
    let Some(name) = name else {
        if json {
            return print_json(&all);
        }
        let rows = all
            .into_iter()
            .map(|v| {
                let sets: std::collections::BTreeSet<&str> =
                    v.workloads.iter().filter_map(|w| w.staged_set.as_deref()).collect();
                let applied = v
                    .workloads
                    .iter()
                    .filter(|w| w.latest_version.is_some_and(|l| l == w.applied_version))
                    .count();
                vec![
                    v.name.clone(),
                    v.stage.to_string(),
                    v.base_version.map_or_else(|| "new".into(), |b| b.to_string()),
                    v.problem.clone().unwrap_or_else(|| format!("{} ({applied} applied)", v.workloads.len())),
                    sets.into_iter().collect::<Vec<_>>().join(" "),
                    format!("{} {}", v.staged_by, v.staged_at.format("%F %T")),
                ]
            })
            .collect();
        print_table(&["name", "stage", "base version", "workloads", "staged sets", "staged"], rows);
        return Ok(());
    };
    let Some(view) = all.into_iter().find(|v| v.name == name) else {
        bail!("no staged ruleset {name:?}");
    };
    if json {
        return print_json(&view);
    }
    println!(
        "# stage {} of ruleset {} (base version {}), staged by {} at {}",
        view.stage,
        view.name,
        view.base_version.map_or_else(|| "none: new".into(), |b| b.to_string()),
        view.staged_by,
        view.staged_at.format("%F %T")
    );
    if let Some(problem) = &view.problem {
        println!("# left out of every render: {problem}");
    }
    for w in &view.workloads {
        println!(
            "# changes {} ({}): staged set {}, latest v{}, applied v{}",
            w.hostname,
            w.id,
            w.staged_set.as_deref().unwrap_or("none"),
            w.latest_version.unwrap_or(0),
            w.applied_version
        );
    }
    print!("{}", serde_norway::to_string(&view.spec)?);
    Ok(())
}

/// `ruleset list` (a table) and `ruleset show NAME` (the file format), from either source.
fn print_rulesets(
    json: bool,
    cmd: &ObjectCmd<RulesetFile>,
    all: Vec<store::RulesetView>,
) -> anyhow::Result<()> {
    if let ObjectCmd::Show { name } = cmd {
        let Some(view) = all.into_iter().find(|r| &r.spec.name == name) else {
            bail!("ruleset {name:?} not found");
        };
        if json {
            return print_json(&view);
        }
        println!("# version: {}", view.version);
        print!("{}", serde_norway::to_string(&view.spec)?);
        return Ok(());
    }
    if json {
        return print_json(&all);
    }
    let rows = all
        .into_iter()
        .map(|r| {
            let scope: Vec<String> =
                r.spec.scope.iter().map(|(k, vs)| format!("{k} in ({})", vs.join(", "))).collect();
            vec![
                r.spec.name,
                r.version.to_string(),
                if r.spec.enabled { "yes" } else { "no" }.into(),
                scope.join(" and "),
                r.spec.rules.len().to_string(),
            ]
        })
        .collect();
    print_table(&["name", "version", "enabled", "scope", "rules"], rows);
    Ok(())
}

/// `innerwall policy …`: policy tests (POL-10), judged on every operator commit.
#[derive(Debug, Subcommand)]
pub enum PolicyCmd {
    /// Named sets of policy tests (YAML or JSON files); each change is itself a checked commit.
    #[command(subcommand, name = "test-set")]
    TestSet(ObjectCmd<TestSetFile>),
    /// Run every policy test on the estate as rendered now, or as a draft would render it
    /// (writes nothing); exits 1 if any fails.
    Test {
        /// JUnit XML on stdout (one testsuite per set, one testcase per test).
        #[arg(long, conflicts_with = "json")]
        junit: bool,
        /// Judge the estate as this draft would render it (`innerwall draft`).
        #[arg(long, value_name = "NAME")]
        draft: Option<String>,
    },
}

/// The test-set file `test-set create` and `test-set update` read.
#[derive(Debug, Args)]
pub struct TestSetFile {
    #[arg(short, long)]
    file: PathBuf,
}

fn read_test_set_file(path: &Path) -> anyhow::Result<foresight::TestSetSpec> {
    let (origin, text) = crate::file::read_bounded(path, policy_tests::MAX_TEST_SET_FILE)?;
    Ok(policy_tests::parse_test_set_file(&origin, &text)?)
}

pub async fn policy(b: &impl Backend, json: bool, cmd: &PolicyCmd) -> anyhow::Result<()> {
    const NOUN: &str = "policy test set";
    match cmd {
        PolicyCmd::Test { junit, draft } => print_run(json, *junit, &b.run_tests(draft.as_deref()).await?),
        PolicyCmd::TestSet(cmd) => match cmd {
            ObjectCmd::Create(TestSetFile { file }) => {
                let spec = read_test_set_file(file)?;
                let done = b.create_test_set(&spec).await?;
                report(json, &format!("{NOUN} {} created (version 1)", spec.name), &done);
                Ok(())
            }
            ObjectCmd::Update { object: TestSetFile { file }, expect } => {
                let spec = read_test_set_file(file)?;
                let expected = expect.required(NOUN, "update", &spec.name)?;
                let done = b.update_test_set(&spec, expected).await?;
                report(json, &format!("{NOUN} {} updated (version {})", spec.name, done.result), &done);
                Ok(())
            }
            ObjectCmd::Delete { name, expect } => {
                let expected = expect.required(NOUN, "delete", name)?;
                let done = b.delete_test_set(name, expected).await?;
                report(json, &format!("{NOUN} {name} deleted"), &done);
                Ok(())
            }
            ObjectCmd::List => print_test_sets(json, None, b.test_sets().await?),
            ObjectCmd::Show { name } => print_test_sets(json, Some(name), vec![b.test_set(name).await?]),
        },
    }
}

fn print_test_sets(json: bool, show: Option<&str>, all: Vec<foresight::TestSetRow>) -> anyhow::Result<()> {
    if let Some(name) = show {
        let Some(row) = all.into_iter().find(|r| r.name == name) else {
            bail!("policy test set {name:?} not found")
        };
        if json {
            return print_json(&row);
        }
        println!("# version: {}", row.version);
        print!("{}", serde_norway::to_string(&row.spec)?);
        return Ok(());
    }
    if json {
        return print_json(&all);
    }
    let rows = all
        .into_iter()
        .map(|r| vec![r.name, r.version.to_string(), r.tests.to_string(), r.description])
        .collect();
    print_table(&["name", "version", "tests", "description"], rows);
    Ok(())
}

/// A run as a table (`--json` the report, `--junit` JUnit XML); failing tests make it an error
/// (exit 1) after the output, naming how many failed.
fn print_run(json: bool, junit: bool, report: &foresight::RunReport) -> anyhow::Result<()> {
    if junit {
        print!("{}", report.junit());
    } else if json {
        print_json(report)?;
    } else {
        let rows = report
            .results
            .iter()
            .map(|r| {
                vec![
                    r.set.clone(),
                    r.test.clone(),
                    r.assertion.clone(),
                    if r.passed { "pass".into() } else { "FAIL".into() },
                    r.failure.as_ref().map_or_else(String::new, |f| f.reason.clone()),
                ]
            })
            .collect();
        print_table(&["set", "test", "assertion", "result", "why"], rows);
    }
    let failed = report.results.iter().filter(|r| !r.passed).count();
    if failed > 0 {
        bail!("{failed} of {} policy test(s) fail", report.results.len());
    }
    Ok(())
}
