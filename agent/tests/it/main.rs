//! The agent's integration tests in real network namespaces: enforcement and capture with real
//! packets, host facts read from the kernel (root required; they fail loudly without it, in CI
//! and outside).

mod capture;
mod config;
mod enforce;
mod evaluator;
mod facts;
mod netns;
