//! The Innerwall control plane as a library: the `innerwall` binary is a thin CLI over it, and
//! end-to-end tests drive it directly. Its rooms, lowest first (a module imports only from the
//! ones before it): `policy` (authored model, render, publish), `identity` (CA, tokens,
//! enrollment, the agent listener), `flows` (evidence ingest, retention, queries), `gate` (the
//! verdict and promotions on that evidence), `foresight` (a change's impact on recorded flows,
//! and policy tests judged on every operator commit, the one commit operator changes go through),
//! `suggest` (rules suggested from recorded flows, accepted into drafts), `operations`
//! (each authored operator change as one call that owns its audit record), `sync` (stream state machine, gateway, NOTIFY
//! bridge), `api` (the operator HTTP API over all of them), `service` (one replica), with
//! `postgres` (the database and its clusters), `admission` (who may hold a connection: the
//! agent, API and metrics listeners), `copy` (binary `COPY` rows), `page` (bounded
//! results) and `metrics` (the replica's Prometheus metrics, which the rooms record into)
//! underneath all of them; `retention` (of the control plane's own tables) reads across them.

pub mod admission;
pub mod api;
pub mod audit;
pub mod backup;
mod batch;
pub mod copy;
pub mod counts;
pub mod error;
pub mod flows;
pub mod foresight;
pub mod gate;
pub mod identity;
pub mod input;
pub mod metrics;
pub mod notice;
pub mod operations;
pub mod page;
pub mod policy;
pub mod postgres;
pub mod rate;
pub mod retention;
pub mod safety;
pub mod service;
pub mod shown;
pub mod suggest;
pub mod sync;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
