//! `innerwall render`, `service`, `address-group` and `ruleset`: authoring the policy model,
//! on this host's database or (`*_remote`) through a control plane's API, printed alike.
//! Services and address groups are the same kind of thing to the CLI — a named, versioned set
//! of members given as flags — so one generic [`ObjectCmd`] and [`catalog`] serve both, each
//! described by a [`Catalog`] impl.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use clap::{Args, Subcommand};
use innerwall_control_plane::counts::CountBounds;
use innerwall_control_plane::error::Error;
use innerwall_control_plane::foresight::{self, drafts, policy_tests};
use innerwall_control_plane::page::{Page, PageRequest};
use innerwall_control_plane::policy::authoring;
use innerwall_control_plane::policy::model::ServiceEntry;
use innerwall_control_plane::policy::spec::{
    self, AddressGroupSpec, MAX_RULESET_FILE, RulesetSpec, ServiceSpec,
};
use innerwall_control_plane::policy::store::{self, AddressGroupView, ServiceView};
use innerwall_wire::policy::Cidr;
use serde::Serialize;
use sqlx::PgConnection;

use crate::api::{ApiClient, segment};
use crate::ctx::Ctx;
use crate::output::{
    Outcome, print_changed, print_changed_outcome, print_json, print_table, report, report_outcome,
};
use crate::pages;

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

/// A named, versioned object an operator creates, updates, deletes and lists from flags: the
/// flags (`Self`), the spec they parse into, and the library calls and view for it.
pub trait Catalog: Args {
    /// As messages name it: `service`, `address group`.
    const NOUN: &'static str;
    /// As audit actions start: `service`, `address-group`.
    const ACTION: &'static str;
    /// The members' table column and audit-detail key: `entries`, `cidrs`.
    const MEMBERS: &'static str;
    /// The API's collection: `/api/v1/services`, `/api/v1/address-groups`.
    const PATH: &'static str;
    type Spec;
    type View: Serialize + serde::de::DeserializeOwned;

    fn spec(&self) -> anyhow::Result<Self::Spec>;
    /// The API's body for a create (with the name) or an update (without).
    fn body(&self, with_name: bool) -> serde_json::Value;
    fn arg_name(&self) -> &str;
    fn name(spec: &Self::Spec) -> &str;
    fn members(spec: &Self::Spec) -> Vec<String>;
    async fn create(conn: &mut PgConnection, spec: &Self::Spec) -> Result<(), Error>;
    /// Returns the new version.
    async fn update(conn: &mut PgConnection, spec: &Self::Spec, expected: i64) -> Result<i64, Error>;
    async fn delete(conn: &mut PgConnection, name: &str, expected: i64) -> Result<(), Error>;
    async fn page(conn: &mut PgConnection, request: &PageRequest) -> Result<Page<Self::View>, Error>;
    async fn show(conn: &mut PgConnection, name: &str) -> Result<Self::View, Error>;
    /// name, version, members, description.
    fn row(view: Self::View) -> Vec<String>;
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
    /// A CIDR or a bare address (a host route); repeatable.
    #[arg(long = "cidr", required = true)]
    cidrs: Vec<String>,
    #[arg(long, default_value = "")]
    description: String,
}

/// Implements [`Catalog`] for a flags struct from the library calls of its kind. The members
/// field has one name in the flags, the spec and the view (`entries`, `cidrs`), which is also
/// the table column and the audit-detail key.
macro_rules! catalog {
    ($args:ty { $members:ident: $parse:path } => $spec:ident, $view:ident, $noun:literal, $action:literal,
     $path:literal, [$create:ident, $update:ident, $delete:ident, $page:ident, $show:ident]) => {
        impl Catalog for $args {
            const NOUN: &'static str = $noun;
            const ACTION: &'static str = $action;
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
            fn name(spec: &$spec) -> &str {
                &spec.name
            }
            fn members(spec: &$spec) -> Vec<String> {
                spec.$members.iter().map(ToString::to_string).collect()
            }
            async fn create(conn: &mut PgConnection, spec: &$spec) -> Result<(), Error> {
                authoring::$create(conn, spec).await.map(drop)
            }
            async fn update(conn: &mut PgConnection, spec: &$spec, expected: i64) -> Result<i64, Error> {
                authoring::$update(conn, spec, expected).await
            }
            async fn delete(conn: &mut PgConnection, name: &str, expected: i64) -> Result<(), Error> {
                authoring::$delete(conn, name, expected).await
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

catalog!(ServiceArgs { entries: ServiceEntry::parse } => ServiceSpec, ServiceView, "service", "service",
    "/api/v1/services", [create_service, update_service, delete_service, service_page, service_view]);
catalog!(GroupArgs { cidrs: Cidr::parse } => AddressGroupSpec, AddressGroupView, "address group",
    "address-group", "/api/v1/address-groups",
    [create_address_group, update_address_group, delete_address_group, address_group_page, address_group_view]);

/// The audit detail of a create or update: the members as written.
fn members_detail<A: Catalog>(spec: &A::Spec) -> serde_json::Value {
    serde_json::Value::Object(serde_json::Map::from_iter([(A::MEMBERS.to_owned(), A::members(spec).into())]))
}

pub async fn catalog<A: Catalog>(ctx: &Ctx, cmd: &ObjectCmd<A>) -> anyhow::Result<()> {
    let (noun, pool, actor) = (A::NOUN, &ctx.pool, ctx.actor.as_str());
    match cmd {
        ObjectCmd::Create(args) => {
            let spec = args.spec()?;
            let name = A::name(&spec);
            let action = format!("{}.create", A::ACTION);
            let done = foresight::commit(pool, actor, &action, name, async |c| {
                A::create(c, &spec).await?;
                Ok(((), members_detail::<A>(&spec)))
            })
            .await?;
            report(ctx.json, &format!("{noun} {name} created (version 1)"), done);
        }
        ObjectCmd::Update { object, expect } => {
            let expected = expect.required(noun, "update", object.arg_name())?;
            let spec = object.spec()?;
            let name = A::name(&spec);
            let action = format!("{}.update", A::ACTION);
            let done = foresight::commit(pool, actor, &action, name, async |c| {
                let version = A::update(c, &spec, expected).await?;
                Ok((version, members_detail::<A>(&spec)))
            })
            .await?;
            report(ctx.json, &format!("{noun} {name} updated (version {})", done.value), done);
        }
        ObjectCmd::Delete { name, expect } => {
            let expected = expect.required(noun, "delete", name)?;
            let action = format!("{}.delete", A::ACTION);
            let done = foresight::commit(pool, actor, &action, name, async |c| {
                A::delete(c, name, expected).await?;
                Ok(((), serde_json::json!({})))
            })
            .await?;
            report(ctx.json, &format!("{noun} {name} deleted"), done);
        }
        ObjectCmd::List => {
            let mut conn = pool.acquire().await?;
            print_objects::<A>(
                ctx.json,
                pages::local(ctx.page_size, None, async |r| A::page(&mut conn, r).await).await?,
            )?;
        }
        ObjectCmd::Show { name } => {
            print_objects::<A>(ctx.json, vec![A::show(&mut *pool.acquire().await?, name).await?])?;
        }
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

/// [`catalog`] over the API: the same messages, tables and `--json`.
pub async fn catalog_remote<A: Catalog>(
    api: &ApiClient,
    json: bool,
    cmd: &ObjectCmd<A>,
) -> anyhow::Result<()> {
    let noun = A::NOUN;
    match cmd {
        ObjectCmd::Create(args) => {
            args.spec()?;
            let name = args.arg_name();
            let done: Outcome<()> = api.write("POST", A::PATH, None, Some(&args.body(true))).await?;
            report_outcome(json, &format!("{noun} {name} created (version 1)"), &done);
        }
        ObjectCmd::Update { object, expect } => {
            let version = expect.required(noun, "update", object.arg_name())?;
            object.spec()?;
            let name = object.arg_name();
            let path = format!("{}/{}", A::PATH, segment(name));
            let done: Outcome<i64> =
                api.write("PUT", &path, Some(version), Some(&object.body(false))).await?;
            report_outcome(json, &format!("{noun} {name} updated (version {})", done.result), &done);
        }
        ObjectCmd::Delete { name, expect } => {
            let version = expect.required(noun, "delete", name)?;
            let path = format!("{}/{}", A::PATH, segment(name));
            let done: Outcome<()> = api.write("DELETE", &path, Some(version), None).await?;
            report_outcome(json, &format!("{noun} {name} deleted"), &done);
        }
        ObjectCmd::List => print_objects::<A>(json, pages::remote(api, A::PATH, None).await?)?,
        ObjectCmd::Show { name } => {
            let view: A::View = api.get(&format!("{}/{}", A::PATH, segment(name))).await?;
            print_objects::<A>(json, vec![view])?;
        }
    }
    Ok(())
}

/// A [`store::RulesetView`] from the API's JSON (the spec is flattened beside `version`).
fn ruleset_view(mut value: serde_json::Value) -> anyhow::Result<store::RulesetView> {
    let version = value
        .as_object_mut()
        .and_then(|o| o.remove("version"))
        .and_then(|v| v.as_i64())
        .context("a ruleset in the answer has no version")?;
    Ok(store::RulesetView { version, spec: serde_json::from_value(value)? })
}

/// [`ruleset`] over the API: the same messages, tables, YAML and `--json`.
pub async fn ruleset_remote(api: &ApiClient, json: bool, cmd: &ObjectCmd<RulesetFile>) -> anyhow::Result<()> {
    const PATH: &str = "/api/v1/rulesets";
    match cmd {
        ObjectCmd::Create(RulesetFile { file }) => {
            let spec = read_ruleset_file(file)?;
            let body = serde_json::to_value(&spec)?;
            let done: Outcome<()> = api.write("POST", PATH, None, Some(&body)).await?;
            report_outcome(json, &format!("ruleset {} created (version 1)", spec.name), &done);
        }
        ObjectCmd::Update { object: RulesetFile { file }, expect } => {
            let spec = read_ruleset_file(file)?;
            let version = expect.required("ruleset", "update", &spec.name)?;
            let path = format!("{PATH}/{}", segment(&spec.name));
            let body = serde_json::to_value(&spec)?;
            let done: Outcome<i64> = api.write("PUT", &path, Some(version), Some(&body)).await?;
            report_outcome(json, &format!("ruleset {} updated (version {})", spec.name, done.result), &done);
        }
        ObjectCmd::Delete { name, expect } => {
            let version = expect.required("ruleset", "delete", name)?;
            let path = format!("{PATH}/{}", segment(name));
            let done: Outcome<()> = api.write("DELETE", &path, Some(version), None).await?;
            report_outcome(json, &format!("ruleset {name} deleted"), &done);
        }
        ObjectCmd::List => {
            let all: Vec<serde_json::Value> = pages::remote(api, PATH, None).await?;
            let all = all.into_iter().map(ruleset_view).collect::<anyhow::Result<Vec<_>>>()?;
            print_rulesets(json, cmd, all)?;
        }
        ObjectCmd::Show { name } => {
            let view = ruleset_view(api.get(&format!("{PATH}/{}", segment(name))).await?)?;
            print_rulesets(json, cmd, vec![view])?;
        }
    }
    Ok(())
}

/// `innerwall render`: every workload rendered now, recorded in the audit log with the
/// versions it moved.
pub async fn render(ctx: &Ctx) -> anyhow::Result<()> {
    let done = authoring::render_audited(&ctx.pool, &ctx.actor).await?;
    print_changed(ctx.json, &done.changed, &done.value);
    Ok(())
}

/// [`render`] over the API.
pub async fn render_remote(api: &ApiClient, json: bool) -> anyhow::Result<()> {
    let done: Outcome<()> = api.write("POST", "/api/v1/render", None, None).await?;
    print_changed_outcome(json, &done);
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

pub async fn ruleset(ctx: &Ctx, cmd: &ObjectCmd<RulesetFile>) -> anyhow::Result<()> {
    let (json, pool, actor) = (ctx.json, &ctx.pool, ctx.actor.as_str());
    match cmd {
        ObjectCmd::Create(RulesetFile { file }) => {
            let spec = read_ruleset_file(file)?;
            let done = foresight::commit(pool, actor, "ruleset.create", &spec.name.clone(), async |c| {
                authoring::create_ruleset(c, &spec).await?;
                Ok(((), serde_json::to_value(&spec).expect("plain data serializes")))
            })
            .await?;
            report(json, &format!("ruleset {} created (version 1)", spec.name), done);
        }
        ObjectCmd::Update { object: RulesetFile { file }, expect } => {
            let spec = read_ruleset_file(file)?;
            let expected = expect.required("ruleset", "update", &spec.name)?;
            let done = foresight::commit(pool, actor, "ruleset.update", &spec.name.clone(), async |c| {
                let v = authoring::update_ruleset(c, &spec, expected).await?;
                Ok((v, serde_json::to_value(&spec).expect("plain data serializes")))
            })
            .await?;
            report(json, &format!("ruleset {} updated (version {})", spec.name, done.value), done);
        }
        ObjectCmd::Delete { name, expect } => {
            let expected = expect.required("ruleset", "delete", name)?;
            let done = foresight::commit(pool, actor, "ruleset.delete", name, async |c| {
                authoring::delete_ruleset(c, name, expected).await?;
                Ok(((), serde_json::json!({})))
            })
            .await?;
            report(json, &format!("ruleset {name} deleted"), done);
        }
        ObjectCmd::List => {
            let mut conn = pool.acquire().await?;
            let all =
                pages::local(ctx.page_size, None, async |r| store::ruleset_page(&mut conn, r).await).await?;
            print_rulesets(json, cmd, all)?;
        }
        ObjectCmd::Show { name } => {
            print_rulesets(json, cmd, vec![store::ruleset_view(&mut *pool.acquire().await?, name).await?])?;
        }
    }
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

pub async fn policy(ctx: &Ctx, cmd: &PolicyCmd) -> anyhow::Result<()> {
    let (json, pool, actor) = (ctx.json, &ctx.pool, ctx.actor.as_str());
    match cmd {
        PolicyCmd::Test { junit, draft } => {
            let report = match draft {
                Some(name) => drafts::run_tests(pool, actor, name, &CountBounds::default()).await?,
                None => foresight::run_policy_tests(pool).await?,
            };
            print_run(json, *junit, &report)
        }
        PolicyCmd::TestSet(cmd) => match cmd {
            ObjectCmd::Create(TestSetFile { file }) => {
                let spec = read_test_set_file(file)?;
                let done = foresight::create_test_set(pool, actor, &spec).await?;
                report(json, &format!("policy test set {} created (version 1)", spec.name), done);
                Ok(())
            }
            ObjectCmd::Update { object: TestSetFile { file }, expect } => {
                let spec = read_test_set_file(file)?;
                let expected = expect.required("policy test set", "update", &spec.name)?;
                let done = foresight::update_test_set(pool, actor, &spec, expected).await?;
                report(
                    json,
                    &format!("policy test set {} updated (version {})", spec.name, done.value),
                    done,
                );
                Ok(())
            }
            ObjectCmd::Delete { name, expect } => {
                let expected = expect.required("policy test set", "delete", name)?;
                let done = foresight::delete_test_set(pool, actor, name, expected).await?;
                report(json, &format!("policy test set {name} deleted"), done);
                Ok(())
            }
            ObjectCmd::List => print_test_sets(json, None, foresight::list_test_sets(pool).await?),
            ObjectCmd::Show { name } => {
                print_test_sets(json, Some(name), vec![foresight::show_test_set(pool, name).await?])
            }
        },
    }
}

/// [`policy`] over the API: the same output.
pub async fn policy_remote(api: &ApiClient, json: bool, cmd: &PolicyCmd) -> anyhow::Result<()> {
    const PATH: &str = "/api/v1/policy-test-sets";
    match cmd {
        PolicyCmd::Test { junit, draft } => {
            let path = match draft {
                Some(name) => format!("/api/v1/drafts/{}/tests", segment(name)),
                None => "/api/v1/policy-tests/run".to_owned(),
            };
            let report: foresight::RunReport = api.write("POST", &path, None, None).await?;
            print_run(json, *junit, &report)
        }
        PolicyCmd::TestSet(cmd) => match cmd {
            ObjectCmd::Create(TestSetFile { file }) => {
                let spec = read_test_set_file(file)?;
                let body = serde_json::to_value(&spec)?;
                let done: Outcome<i64> = api.write("POST", PATH, None, Some(&body)).await?;
                report_outcome(json, &format!("policy test set {} created (version 1)", spec.name), &done);
                Ok(())
            }
            ObjectCmd::Update { object: TestSetFile { file }, expect } => {
                let spec = read_test_set_file(file)?;
                let version = expect.required("policy test set", "update", &spec.name)?;
                let path = format!("{PATH}/{}", segment(&spec.name));
                let body = serde_json::to_value(&spec)?;
                let done: Outcome<i64> = api.write("PUT", &path, Some(version), Some(&body)).await?;
                report_outcome(
                    json,
                    &format!("policy test set {} updated (version {})", spec.name, done.result),
                    &done,
                );
                Ok(())
            }
            ObjectCmd::Delete { name, expect } => {
                let version = expect.required("policy test set", "delete", name)?;
                let path = format!("{PATH}/{}", segment(name));
                let done: Outcome<()> = api.write("DELETE", &path, Some(version), None).await?;
                report_outcome(json, &format!("policy test set {name} deleted"), &done);
                Ok(())
            }
            ObjectCmd::List => print_test_sets(json, None, api.get(PATH).await?),
            ObjectCmd::Show { name } => {
                print_test_sets(json, Some(name), vec![api.get(&format!("{PATH}/{}", segment(name))).await?])
            }
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
