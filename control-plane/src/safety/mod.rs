//! Safety nets for enforcement (issue 31), the operations above the policy and the gate that
//! catch what a change or a promotion got wrong: management access no policy can take away
//! ([`management`]), rollback to an earlier version's authored source ([`rollback`]), and the
//! auto-demotion guard of a promotion to enforcement ([`guard`]), promotions that revert
//! unless confirmed ([`confirm`]), and rulesets staged beside the rules in force until promoted
//! on evidence ([`staged`]). Each is one library call that owns its validation and audit
//! record.

pub mod confirm;
pub mod guard;
pub mod management;
pub mod rollback;
pub mod staged;
