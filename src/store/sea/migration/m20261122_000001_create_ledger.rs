//! Accounts, keys, grants and the call log. The `CHECK` constraints back up the code: no bucket
//! can go negative, and a call's two charged parts always add up to its price.

use sea_orm_migration::prelude::*;
use sea_orm_migration::schema::*;

#[derive(DeriveMigrationName)]
pub(super) struct Migration;

#[derive(DeriveIden, Clone, Copy)]
enum MgAccounts {
    Table,
    Id,
    Name,
    SubscriptionCredits,
    TopupCredits,
    CreatedAt,
}

#[derive(DeriveIden, Clone, Copy)]
enum MgApiKeys {
    Table,
    Id,
    AccountId,
    KeyHash,
    DisplayPrefix,
    RevokedAt,
    CreatedAt,
}

#[derive(DeriveIden, Clone, Copy)]
enum MgCreditGrants {
    Table,
    Id,
    AccountId,
    Bucket,
    Amount,
    CreatedAt,
}

#[derive(DeriveIden, Clone, Copy)]
enum MgCalls {
    Table,
    Id,
    AccountId,
    KeyId,
    Protocol,
    Model,
    Price,
    ChargedSubscription,
    ChargedTopup,
    Status,
    UpstreamStatus,
    UpstreamError,
    InputTokens,
    OutputTokens,
    CreatedAt,
    FinishedAt,
}

/// A point in time: `timestamptz` on `PostgreSQL`, text on `SQLite`, and `DATETIME(6)` on `MySQL`,
/// whose `TIMESTAMP` ends in 2038 and may update itself.
pub(super) fn moment<T: IntoIden>(
    manager: &SchemaManager<'_>,
    column: T,
    nullable: bool,
) -> ColumnDef {
    let mut definition = ColumnDef::new(column);
    if manager.get_database_backend() == sea_orm::DbBackend::MySql {
        definition.custom("DATETIME(6)".into_iden());
    } else {
        definition.timestamp_with_time_zone();
    }
    if nullable {
        definition.null();
    } else {
        definition.not_null();
    }
    definition
}

fn non_negative<T: IntoIden + Copy + 'static>(column: T) -> ColumnDef {
    big_integer(column).check(Expr::col(column).gte(0)).take()
}

fn account_fk<T: IntoIden + 'static>(
    from: T,
    column: impl IntoIden + 'static,
) -> ForeignKeyCreateStatement {
    ForeignKey::create()
        .from(from, column)
        .to(MgAccounts::Table, MgAccounts::Id)
        .on_delete(ForeignKeyAction::Restrict)
        .take()
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .create_table(
                Table::create()
                    .table(MgAccounts::Table)
                    .col(big_pk_auto(MgAccounts::Id))
                    .col(string(MgAccounts::Name))
                    .col(non_negative(MgAccounts::SubscriptionCredits))
                    .col(non_negative(MgAccounts::TopupCredits))
                    .col(moment(manager, MgAccounts::CreatedAt, false))
                    .take(),
            )
            .await?;

        manager
            .create_table(
                Table::create()
                    .table(MgApiKeys::Table)
                    .col(big_pk_auto(MgApiKeys::Id))
                    .col(big_integer(MgApiKeys::AccountId))
                    .col(string_len_uniq(MgApiKeys::KeyHash, 64))
                    .col(string_len(MgApiKeys::DisplayPrefix, 32))
                    .col(moment(manager, MgApiKeys::RevokedAt, true))
                    .col(moment(manager, MgApiKeys::CreatedAt, false))
                    .foreign_key(&mut account_fk(MgApiKeys::Table, MgApiKeys::AccountId))
                    .take(),
            )
            .await?;

        manager
            .create_table(
                Table::create()
                    .table(MgCreditGrants::Table)
                    .col(big_pk_auto(MgCreditGrants::Id))
                    .col(big_integer(MgCreditGrants::AccountId))
                    .col(
                        string_len(MgCreditGrants::Bucket, 16).check(
                            Expr::col(MgCreditGrants::Bucket).is_in(["subscription", "topup"]),
                        ),
                    )
                    .col(
                        big_integer(MgCreditGrants::Amount)
                            .check(Expr::col(MgCreditGrants::Amount).gt(0)),
                    )
                    .col(moment(manager, MgCreditGrants::CreatedAt, false))
                    .foreign_key(&mut account_fk(
                        MgCreditGrants::Table,
                        MgCreditGrants::AccountId,
                    ))
                    .take(),
            )
            .await?;
        manager
            .create_index(
                Index::create()
                    .name("mg_credit_grants_account")
                    .table(MgCreditGrants::Table)
                    .col(MgCreditGrants::AccountId)
                    .take(),
            )
            .await?;

        manager
            .create_table(
                Table::create()
                    .table(MgCalls::Table)
                    .col(big_pk_auto(MgCalls::Id))
                    .col(big_integer(MgCalls::AccountId))
                    .col(big_integer(MgCalls::KeyId))
                    .col(string_len(MgCalls::Protocol, 32))
                    .col(string(MgCalls::Model))
                    .col(big_integer(MgCalls::Price).check(Expr::col(MgCalls::Price).gt(0)))
                    .col(non_negative(MgCalls::ChargedSubscription))
                    .col(non_negative(MgCalls::ChargedTopup))
                    .col(
                        string_len(MgCalls::Status, 16)
                            .check(Expr::col(MgCalls::Status).is_in(["pending", "ok", "refunded"])),
                    )
                    .col(integer_null(MgCalls::UpstreamStatus))
                    .col(text_null(MgCalls::UpstreamError))
                    .col(big_integer_null(MgCalls::InputTokens))
                    .col(big_integer_null(MgCalls::OutputTokens))
                    .col(moment(manager, MgCalls::CreatedAt, false))
                    .col(moment(manager, MgCalls::FinishedAt, true))
                    .check((
                        "mg_calls_charged_adds_up_to_price",
                        Expr::col(MgCalls::ChargedSubscription)
                            .add(Expr::col(MgCalls::ChargedTopup))
                            .eq(Expr::col(MgCalls::Price)),
                    ))
                    .foreign_key(&mut account_fk(MgCalls::Table, MgCalls::AccountId))
                    .foreign_key(
                        ForeignKey::create()
                            .from(MgCalls::Table, MgCalls::KeyId)
                            .to(MgApiKeys::Table, MgApiKeys::Id)
                            .on_delete(ForeignKeyAction::Restrict),
                    )
                    .take(),
            )
            .await?;
        manager
            .create_index(
                Index::create()
                    .name("mg_calls_account_newest")
                    .table(MgCalls::Table)
                    .col(MgCalls::AccountId)
                    .col(MgCalls::Id)
                    .take(),
            )
            .await?;
        manager
            .create_index(
                Index::create()
                    .name("mg_calls_status_created")
                    .table(MgCalls::Table)
                    .col(MgCalls::Status)
                    .col(MgCalls::CreatedAt)
                    .take(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        for table in [
            MgCalls::Table.into_iden(),
            MgCreditGrants::Table.into_iden(),
            MgApiKeys::Table.into_iden(),
            MgAccounts::Table.into_iden(),
        ] {
            manager
                .drop_table(Table::drop().table(table).take())
                .await?;
        }
        Ok(())
    }
}
