//! The agent's integration tests: enforcement in real network namespaces with real packets
//! (root required; they fail loudly without it, in CI and outside).

mod capture;
mod enforce;
mod evaluator;
mod netns;
