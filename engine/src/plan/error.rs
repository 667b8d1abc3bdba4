//! Why a plan cannot be built or does not fit: [`PlanError`], with each tier over budget
//! as a [`Shortfall`].
//!
//! Not here: the checks that find a shortfall and the suggestions of what would fit
//! (`fit.rs`).

use std::fmt;

use super::tier::Tier;

/// Why a plan cannot be built or run.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlanError {
    /// The policy asked for something the engine cannot do.
    #[error("policy {policy}: {reason}")]
    BadPolicy {
        /// The policy's name.
        policy: String,
        /// What is wrong, naming the block.
        reason: String,
    },
    /// The plan needs more of one or more tiers than their budgets.
    #[error(
        "plan {policy} does not fit: {tiers}{suggestions}",
        tiers = short.iter().map(ToString::to_string).collect::<Vec<_>>().join(", and "),
        suggestions = if suggestions.is_empty() { String::new() } else { format!("; {}", suggestions.join("; ")) }
    )]
    DoesNotFit {
        /// The policy's name.
        policy: String,
        /// Every tier over budget, fastest tier first.
        short: Vec<Shortfall>,
        /// What would fit instead.
        suggestions: Vec<String>,
    },
    /// The step cannot be planned at all (bad shape).
    #[error("{0}")]
    Invalid(String),
}

/// A tier a plan needs more of than its budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shortfall {
    /// The tier.
    pub tier: Tier,
    /// Bytes the plan needs there.
    pub need_bytes: u64,
    /// The budget.
    pub budget_bytes: u64,
}

impl fmt::Display for Shortfall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the {} tier needs {} but the budget is {} ({} short)",
            self.tier,
            fmt_bytes(self.need_bytes),
            fmt_bytes(self.budget_bytes),
            fmt_bytes(self.need_bytes.saturating_sub(self.budget_bytes))
        )
    }
}

/// Bytes in binary units, for messages.
pub fn fmt_bytes(bytes: u64) -> String {
    strata_storage::format_bytes(bytes)
}
