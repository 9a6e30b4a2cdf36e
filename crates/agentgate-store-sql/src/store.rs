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
//!   `crate::views::{set_user_cap, sweep}(&Store, …)`;
//! - `crate::orphans`: [`OrphanSql`](crate::orphans::OrphanSql) for `crate::steps::Sql`;
//! - a `config: Config` field, a `wakeups:`
//!   [`Wakeups`](crate::wakeups::Wakeups) field (session releases) and an
//!   `event_wakeups:` one (turns' new events, by turn id);
//! - optionally `listen = path, announce = path`: a `fn(&Store)` called
//!   before every watch, which starts (once) whatever feeds the wakeups from
//!   other nodes, and an `async fn(&Store, &TurnId)` called after an append
//!   commits, which tells other nodes (it reports no error: a follower
//!   that misses it re-reads within its poll).

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
            listen = $crate::store::in_process_only,
            announce = $crate::store::no_announcement
        );
    };
    ($store:ty, listen = $listen:path, announce = $announce:path) => {
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
                crate::views::set_user_cap(self, user_id, cap).await
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

/// The `listen` of a store whose releases reach only this process's
/// waiters (SQLite, MySQL): nothing to start.
pub fn in_process_only<T>(_store: &T) {}

/// The `announce` of a store whose new events reach only this process's
/// followers (SQLite, MySQL): followers elsewhere find them by their poll.
pub async fn no_announcement<T>(_store: &T, _turn_id: &agentgate_core::ids::TurnId) {}
