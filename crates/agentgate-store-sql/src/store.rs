//! The `Store` trait implemented once for every SQL store ([`impl_store!`]).
//!
//! `agentgate_core::store::Store` is foreign to this crate and to every
//! store's generic parameter, so Rust's coherence rules forbid one blanket
//! `impl<T> Store for T`; this macro writes the same impl into each store
//! crate instead. It fixes the layout a SQL store follows, one file per
//! concern:
//!
//! - `crate::steps::Sql<'_>(&Store)`: [`BeginTx`](crate::begin::BeginTx)
//!   and [`LayeredBeginSql`](crate::begin::layered::LayeredBeginSql), the
//!   begin's dialect (in `crate::begin`);
//! - `crate::steps::Sql<'_>(&Store)`: [`StepTx`](crate::StepTx),
//!   [`ClaimSql`](crate::claim::ClaimSql),
//!   [`ToolEndingSql`](crate::tool::ToolEndingSql) and
//!   [`HeartbeatSql`](crate::heartbeat::HeartbeatSql);
//! - `crate::steps::end_turn(&Store, &LeaseRef, &Ending)`;
//! - `crate::steps::Sql` is also [`Run`](crate::query::Run) (through
//!   [`impl_run!`](crate::impl_run), in `crate::run`) and
//!   [`ViewSql`](crate::views::ViewSql), plus
//!   `crate::views::sweep(&Store)`;
//! - `crate::orphans`: [`OrphanSql`](crate::orphans::OrphanSql) for `crate::steps::Sql`;
//! - a `config: Config` field, a `wakeups:`
//!   [`Wakeups`](crate::wakeups::Wakeups) field (session releases) and an
//!   `event_wakeups:` one (turns' new events, by turn id);
//! - a `leases: Option<Arc<dyn LeaseLayer>>` field (the Redis lease layer);
//! - optionally `listen = path, announce = path`: a `fn(&Store)` called
//!   before every watch, which starts (once) whatever feeds the wakeups from
//!   other nodes, and an `async fn(&Store, &TurnId)` called after an append
//!   commits, which tells other nodes (it reports no error: a follower
//!   that misses it re-reads within its poll). A store that names none
//!   (SQLite, MySQL) has no notification of its own: it announces and
//!   listens through its lease layer when it has one
//!   ([`listen_through_layer`], [`announce_through_layer`], and
//!   [`release_through_layer`] for releases), and otherwise its waiters and
//!   followers on other nodes poll. A store that names them (PostgreSQL)
//!   announces releases in its own SQL.

use std::sync::Arc;

use agentgate_core::ids::TurnId;
use agentgate_core::lease::{Announced, LeaseLayer};

use crate::wakeups::Wakeups;

/// Implements `agentgate_core::store::Store` for `$store` over the layout
/// the [module documentation](self) names, and `Debug` (its configuration,
/// never its URL).
// `crate::` here means the store crate that invokes the macro, on purpose:
// its modules are the dialect.
#[allow(clippy::crate_in_macro_def)]
#[macro_export]
macro_rules! impl_store {
    ($store:ty) => {
        $crate::impl_store!(
            $store,
            listen = $crate::store::listen_through_layer,
            announce = $crate::store::announce_through_layer,
            release = $crate::store::release_through_layer
        );
    };
    ($store:ty, listen = $listen:path, announce = $announce:path) => {
        $crate::impl_store!(
            $store,
            listen = $listen,
            announce = $announce,
            release = $crate::store::released_in_sql
        );
    };
    ($store:ty, listen = $listen:path, announce = $announce:path, release = $release:path) => {
        impl $crate::store::LayerFields for $store {
            fn lease_layer(
                &self,
            ) -> Option<&::std::sync::Arc<dyn ::agentgate_core::lease::LeaseLayer>> {
                self.leases.as_ref()
            }

            fn release_wakeups(&self) -> &$crate::wakeups::Wakeups {
                &self.wakeups
            }

            fn event_wakeups(&self) -> &$crate::wakeups::Wakeups {
                &self.event_wakeups
            }
        }

        #[$crate::async_trait]
        impl ::agentgate_core::store::Store for $store {
            fn config(&self) -> &::agentgate_core::config::Config {
                &self.config
            }

            async fn begin(
                &self,
                command: &::agentgate_core::model::BeginCommand,
            ) -> ::agentgate_core::error::Result<::agentgate_core::model::BeginOutcome> {
                $crate::begin::begin(&crate::steps::Sql(self), command).await
            }

            async fn heartbeat(
                &self,
                lease: &::agentgate_core::model::LeaseRef,
            ) -> ::agentgate_core::error::Result<::agentgate_core::store::LeaseStatus> {
                $crate::heartbeat::heartbeat(&crate::steps::Sql(self), lease).await
            }

            async fn claim_tool(
                &self,
                lease: &::agentgate_core::model::LeaseRef,
                call: &::agentgate_core::model::ToolCall,
            ) -> ::agentgate_core::error::Result<::agentgate_core::model::ToolClaim> {
                $crate::claim::claim_tool(&crate::steps::Sql(self), lease, call).await
            }

            async fn complete_tool(
                &self,
                lease: &::agentgate_core::model::LeaseRef,
                execution_id: &::agentgate_core::ids::ExecutionId,
                completion: ::agentgate_core::store::Completion<'_>,
            ) -> ::agentgate_core::error::Result<::serde_json::Value> {
                $crate::tool::complete_tool(
                    &crate::steps::Sql(self),
                    lease,
                    execution_id,
                    completion,
                )
                .await
            }

            async fn fail_tool(
                &self,
                lease: &::agentgate_core::model::LeaseRef,
                execution_id: &::agentgate_core::ids::ExecutionId,
                error: &::agentgate_core::canonical::CanonicalJson,
            ) -> ::agentgate_core::error::Result<()> {
                $crate::tool::fail_tool(&crate::steps::Sql(self), lease, execution_id, error).await
            }

            async fn end_turn(
                &self,
                lease: &::agentgate_core::model::LeaseRef,
                ending: &::agentgate_core::model::Ending,
            ) -> ::agentgate_core::error::Result<::agentgate_core::model::TurnView> {
                let view = crate::steps::end_turn(self, lease, ending).await?;
                self.wakeups.released(view.session_id.as_str());
                $release(self, view.session_id.as_str()).await;
                Ok(view)
            }

            async fn turn(
                &self,
                turn_id: &::agentgate_core::ids::TurnId,
            ) -> ::agentgate_core::error::Result<Option<::agentgate_core::model::TurnView>> {
                $crate::views::turn(&crate::steps::Sql(self), turn_id).await
            }

            async fn request_cancel(
                &self,
                turn_id: &::agentgate_core::ids::TurnId,
            ) -> ::agentgate_core::error::Result<Option<::agentgate_core::model::TurnView>> {
                $crate::views::request_cancel(&crate::steps::Sql(self), turn_id).await
            }

            async fn force_release(
                &self,
                session_id: &::agentgate_core::ids::SessionId,
                only: Option<&::agentgate_core::ids::TurnId>,
            ) -> ::agentgate_core::error::Result<Option<::agentgate_core::model::TurnView>> {
                let sql = crate::steps::Sql(self);
                let released = $crate::orphans::force_release(&sql, session_id, only).await?;
                if released.is_some() {
                    self.wakeups.released(session_id.as_str());
                    $release(self, session_id.as_str()).await;
                }
                match released {
                    Some(turn_id) => match $crate::views::turn(&sql, &turn_id).await? {
                        Some(view) => Ok(Some(view)),
                        None => Err(::agentgate_core::error::Error::corrupt(format!(
                            "the released turn {turn_id} is missing right after its release"
                        ))),
                    },
                    None => Ok(None),
                }
            }

            fn watch_releases(
                &self,
                session_id: &::agentgate_core::ids::SessionId,
            ) -> Box<dyn ::agentgate_core::store::ReleaseWatch> {
                $listen(self);
                self.wakeups.watch(session_id)
            }

            async fn append_events(
                &self,
                lease: &::agentgate_core::model::LeaseRef,
                events: &[::agentgate_core::model::NewEvent],
            ) -> ::agentgate_core::error::Result<u64> {
                let last = $crate::events::append(&crate::steps::Sql(self), lease, events).await?;
                self.event_wakeups.released(lease.turn_id.as_str());
                $announce(self, &lease.turn_id).await;
                Ok(last)
            }

            async fn events(
                &self,
                turn_id: &::agentgate_core::ids::TurnId,
                after: u64,
                limit: u32,
            ) -> ::agentgate_core::error::Result<Option<::agentgate_core::model::EventPage>> {
                $crate::events::page(&crate::steps::Sql(self), turn_id, after, limit).await
            }

            fn watch_events(
                &self,
                turn_id: &::agentgate_core::ids::TurnId,
            ) -> Box<dyn ::agentgate_core::store::ReleaseWatch> {
                $listen(self);
                self.event_wakeups.watch_key(turn_id.as_str())
            }

            async fn executions(
                &self,
                turn_id: &::agentgate_core::ids::TurnId,
                page: &::agentgate_core::page::ExecutionPageRequest,
            ) -> ::agentgate_core::error::Result<::agentgate_core::page::ExecutionPage> {
                $crate::views::executions(&crate::steps::Sql(self), turn_id, page).await
            }

            async fn session(
                &self,
                session_id: &::agentgate_core::ids::SessionId,
            ) -> ::agentgate_core::error::Result<Option<::agentgate_core::model::SessionView>> {
                $crate::views::session(&crate::steps::Sql(self), session_id).await
            }

            async fn user(
                &self,
                user_id: &::agentgate_core::ids::UserId,
            ) -> ::agentgate_core::error::Result<::agentgate_core::model::UserView> {
                $crate::views::user(&crate::steps::Sql(self), user_id).await
            }

            async fn set_user_cap(
                &self,
                user_id: &::agentgate_core::ids::UserId,
                cap: Option<u32>,
            ) -> ::agentgate_core::error::Result<()> {
                $crate::views::set_user_cap(&crate::steps::Sql(self), user_id, cap).await
            }

            async fn set_session_policy(
                &self,
                user_id: &::agentgate_core::ids::UserId,
                session_id: &::agentgate_core::ids::SessionId,
                on_busy: ::agentgate_core::model::OnBusy,
            ) -> ::agentgate_core::error::Result<::agentgate_core::model::SessionView> {
                $crate::views::set_session_policy(&crate::steps::Sql(self), user_id, session_id, on_busy)
                    .await
            }

            async fn overview(
                &self,
                limit: u32,
            ) -> ::agentgate_core::error::Result<::agentgate_core::model::Overview> {
                $crate::views::overview(&crate::steps::Sql(self), limit).await
            }

            async fn sweep(
                &self,
            ) -> ::agentgate_core::error::Result<::agentgate_core::model::SweepReport> {
                let abandoned = ::agentgate_core::store::Store::abandon_orphans(self).await?;
                let released =
                    ::agentgate_core::store::Store::release_ignored_cancels(self).await?;
                let deleted = crate::views::sweep(self).await?;
                Ok(::agentgate_core::model::SweepReport {
                    abandoned,
                    released,
                    ..deleted
                })
            }

            async fn ignored_cancels(
                &self,
                limit: u32,
            ) -> ::agentgate_core::error::Result<Vec<::agentgate_core::model::IgnoredCancel>> {
                $crate::orphans::ignored_cancels(&crate::steps::Sql(self), limit).await
            }

            async fn orphans(
                &self,
                filter: &::agentgate_core::model::OrphanFilter,
                limit: u32,
            ) -> ::agentgate_core::error::Result<Vec<::agentgate_core::model::Orphan>> {
                $crate::orphans::list(&crate::steps::Sql(self), filter, limit).await
            }

            async fn queue_heads(
                &self,
                session: Option<&::agentgate_core::ids::SessionId>,
                filter: &::agentgate_core::model::OrphanFilter,
                limit: u32,
            ) -> ::agentgate_core::error::Result<Vec<::agentgate_core::model::Orphan>> {
                $crate::orphans::queue_heads(&crate::steps::Sql(self), session, filter, limit)
                    .await
            }

            async fn abandon(
                &self,
                orphan: &::agentgate_core::model::Orphan,
            ) -> ::agentgate_core::error::Result<bool> {
                let abandoned = $crate::orphans::abandon(&crate::steps::Sql(self), orphan).await?;
                if abandoned {
                    self.wakeups.released(orphan.session_id.as_str());
                    $release(self, orphan.session_id.as_str()).await;
                }
                Ok(abandoned)
            }
        }

        impl ::std::fmt::Debug for $store {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                // Never the URL: it may hold a password.
                f.debug_struct(stringify!($store))
                    .field("config", &self.config)
                    .finish_non_exhaustive()
            }
        }
    };
}

/// What the announcing functions below read of a store (`impl_store!`
/// implements it from the fields it requires).
pub trait LayerFields {
    /// The lease layer, if the store has one.
    fn lease_layer(&self) -> Option<&Arc<dyn LeaseLayer>>;
    /// The wakeups of waiting begins, by session.
    fn release_wakeups(&self) -> &Wakeups;
    /// The wakeups of event followers, by turn.
    fn event_wakeups(&self) -> &Wakeups;
}

/// A store's two wakeups, where its lease layer delivers other nodes'
/// announcements.
struct LayerWakeups {
    releases: Wakeups,
    events: Wakeups,
}

impl Announced for LayerWakeups {
    fn released(&self, session_id: &str) {
        self.releases.released(session_id);
    }

    fn events(&self, turn_id: &str) {
        self.events.released(turn_id);
    }

    fn listening(&self, listening: bool) {
        self.releases.listening(listening);
        self.events.listening(listening);
    }
}

/// The `listen` of a store without notification of its own: its lease
/// layer's announcements (Redis pub/sub), if it has a layer, else nothing
/// (other nodes' releases and events are found by polling).
pub fn listen_through_layer<T: LayerFields>(store: &T) {
    if let Some(layer) = store.lease_layer() {
        layer.listen(Arc::new(LayerWakeups {
            releases: store.release_wakeups().clone(),
            events: store.event_wakeups().clone(),
        }));
    }
}

/// The `announce` of a store without notification of its own: through its
/// lease layer, if any.
pub async fn announce_through_layer<T: LayerFields>(store: &T, turn_id: &TurnId) {
    if let Some(layer) = store.lease_layer() {
        layer.announce_events(turn_id.as_str()).await;
    }
}

/// The `release` of a store without notification of its own: through its
/// lease layer, if any.
pub async fn release_through_layer<T: LayerFields>(store: &T, session_id: &str) {
    if let Some(layer) = store.lease_layer() {
        layer.announce_release(session_id).await;
    }
}

/// The `release` of a store whose release statements announce themselves
/// (PostgreSQL's `pg_notify` in the same transaction): nothing more.
pub async fn released_in_sql<T>(_store: &T, _session_id: &str) {}
