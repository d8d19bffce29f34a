"""What train and diagnose both look at: where in the user's code something happened."""
