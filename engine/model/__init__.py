"""The forward pass and what feeds it: model, attention, loader, chat template,
packed linears, model runner."""
