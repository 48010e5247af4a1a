//! Suggested policy from recorded flows (FLOW-9, issue 28), the room after `foresight`: an
//! accepted suggestion lands in a draft. `generalise` is the pure core; `observe` reads what it
//! needs (flows no rule of the applied version admits, the estate, gaps); `lifecycle` keeps
//! accepted and ignored suggestions.

mod generalise;
mod observe;

pub use generalise::{
    DEFAULT_EPHEMERAL, DEFAULT_MAX_BREADTH, Destination, Estate, Evidence, Excluded, Ignored, LEARNING_MS,
    Labels, MAX_HOST_ROUTES, Managed, Observation, Params, State, SuggestedPeer, SuggestedService,
    Suggestion, Suggestions, fingerprint, group_text, rule_spec, ruleset_files, ruleset_name, rulesets,
    source_text, suggest,
};
pub use observe::{Accepted, MAX_IDS, MAX_SUGGESTIONS, Request, accept, ignore, range_since, suggest as run};
